"""`canvasq adapt --decoder official`: certainty distillation for the native sampler (issue 35).

Official's stopping rule ends a canvas when its argmax has held for a step and its mean entropy is
under the confidence threshold; a canvas the model already gets right but is unsure of keeps
stepping. This trains a LoRA so that the model is sure sooner on the answers it already gives, the
idea of dParallel's certainty-forcing distillation, on the testbed's native sampler:

1. **rollout**: official (the model with the current LoRA; round 0: the base model, the teacher)
   decodes a fresh share of train-split problems (never dev or eval) and records, for a `keep` share
   of its steps, each canvas's input as the decoder saw it: the tokens (accepted draws and uniform
   noise), the top-k self-conditioning it fed, the context before it. Only rows whose answer the
   task's checker verifies are kept, and each recorded state's target is the canvas's own final
   argmax (the trajectory's end, not a reference answer);
2. **train**: cross-entropy to that target on every position (official re-decides every position
   every step; digits weighted up as train.py does) plus `certainty_weight` × the entropy of the
   positions whose argmax already is the target: certainty is forced only where the model is right,
   never onto a wrong token;
3. the round's adapter is saved and the next round rolls out with it (DAgger-style: the shorter
   trajectories of a surer model are the states it meets).

Decoders take the result with `official:adapter_path=<out>` (decoders/adapters.py merges it).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable

import torch

from canvasq.testbed import tasks
from canvasq.testbed.adapt_data import State
from canvasq.testbed.train_loss import digit_weights


def recording_official(bundle, overrides: dict, keep: float, seed: int):
    """An official decoder with `overrides` that snapshots a `keep` share of its canvases' steps
    (`.snaps`: (custom_id, canvas start, context, tokens, top-k SC or None)) and every canvas's final
    tokens (`.finals`: (custom_id, canvas start) -> ids)."""
    from canvasq.decoders.official import OfficialDecoder
    from canvasq.decoders.registry import make_config

    class Recording(OfficialDecoder):
        keep: float
        rng: random.Random
        snaps: list[tuple]
        finals: dict[tuple[str, int], list[int]]

        def step(self, seqs):
            for s in seqs:
                if s.canvases and self.rng.random() < self.keep:
                    cv = s.canvases[0]
                    sc = None if cv.sc is None else (cv.sc[0].cpu().clone(), cv.sc[1].float().cpu().clone())
                    ctx = list(s.req.prompt_ids) + list(s.out)
                    self.snaps.append((s.req.custom_id, cv.start, ctx, cv.tokens.cpu().clone(), sc))
            return super().step(seqs)

        def retire_canvases(self, seqs, tokens):
            for s, toks in zip(seqs, tokens):
                self.finals[(s.req.custom_id, s.canvases[0].start)] = list(toks)
            return super().retire_canvases(seqs, tokens)

    dec = Recording(bundle, make_config("official", overrides))
    dec.keep, dec.rng, dec.snaps, dec.finals = keep, random.Random(seed), [], {}
    return dec


def rollout(bundle, problems, overrides: dict, keep: float, seed: int, batch_size: int) -> dict:
    """Official decodes `problems` with `overrides`; returns the verified rows' states (`states`), how
    many answers were right (`right`) and the forwards per request (`forwards`)."""
    from canvasq.decoders.types import DecodeBatch, DecodeRequest

    dec = recording_official(bundle, overrides, keep, seed)
    right: set[str] = set()
    forwards = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        max_tokens = [tasks.ANSWER_CANVASES[p.task] * bundle.canvas_length for p in chunk]
        reqs = [
            DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, p.task), m, p.task)
            for p, m in zip(chunk, max_tokens)
        ]
        for p, r in zip(chunk, dec.decode(DecodeBatch(reqs, seed=seed * 104_729 + start))):
            forwards += r.forwards
            if r.error is None and tasks.verify(p, r.text):
                right.add(str(p.uid))
    V = dec.V
    states = [
        _state(ctx, tokens, dec.finals[(uid, at)], sc, V)
        for uid, at, ctx, tokens, sc in dec.snaps
        if uid in right and (uid, at) in dec.finals
    ]
    return {"states": states, "right": len(right), "forwards": forwards / max(1, len(problems))}


def _state(ctx: list[int], tokens: torch.Tensor, final: list[int], sc, vocab: int) -> State:
    """One recorded step as adapt_data's `State` (one canvas; its top-k SC as dense logits, -inf
    outside the top k, which softmaxes to the same renormalised distribution)."""
    C = int(tokens.numel())
    dense, rows = None, torch.zeros(C, dtype=torch.bool)
    if sc is not None:
        dense = torch.full((C, vocab), float("-inf"))
        dense.scatter_(1, sc[0].long(), sc[1])
        dense, rows = dense.to(torch.float16), torch.ones(C, dtype=torch.bool)
    return State(
        ctx=torch.tensor(ctx, dtype=torch.long),
        tokens=tokens.long(),
        target=torch.tensor(final, dtype=torch.long),
        train=torch.ones(C, dtype=torch.bool),
        sc=dense,
        sc_rows=rows,
    )


def certainty_loss(model, batch, canvas: int, weight: float, token_weight=None):
    """(loss, its cross-entropy part, its entropy part) on one batch (module docstring, step 2)."""
    from canvasq.testbed.adapt import _sc_rows, decoder_inputs

    kw = decoder_inputs(model, batch, canvas)
    with _sc_rows(model, batch.sc_rows if batch.sc is not None else None):
        logits = model(**kw, self_conditioning_logits=batch.sc).logits.float()
    logp = torch.log_softmax(logits, -1)
    target, train = batch.target, batch.train
    w = train.float() * (token_weight[target] if token_weight is not None else 1.0)
    ce = (-logp.gather(-1, target[..., None])[..., 0] * w).sum() / w.sum().clamp_min(1.0)
    entropy = -(logp.exp() * logp).sum(-1)
    right = train & (logp.argmax(-1) == target)
    ent = (entropy * right).sum() / train.sum().clamp_min(1)
    return ce + weight * ent, float(ce.detach()), float(ent.detach())


def distil(bundle, st, log: Callable[[str], None]) -> dict:
    """Train the adapter (module docstring) with `AdaptSettings` `st`; returns the report also written
    to `<out>/adapt_report.json`."""
    from canvasq.testbed.adapt import _student, _train, optimiser, settings_json

    t0 = time.time()
    st.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(st.seed)
    problems = [
        p
        for i, task in enumerate(st.tasks)
        for p in tasks.generate(task, st.teacher_n, st.seed * 1_000 + i, "train")
    ]
    random.Random(st.seed).shuffle(problems)
    peft_model = _student(bundle, st)
    params, opt = optimiser(peft_model, st)
    weights = digit_weights(bundle.tokenizer, bundle.config.text_config.vocab_size, 4.0, bundle.device)
    C = bundle.canvas_length

    def loss_fn(model, batch):
        return certainty_loss(model, batch, C, st.certainty_weight, weights)

    buffer: list[State] = []
    student, rounds = (str(st.init) if st.init else None), []
    for r in range(st.rounds):
        share = problems[r :: st.rounds]
        t1 = time.time()
        over = {"adapter_path": student} if student else {}
        got = rollout(bundle, share, over, st.keep, st.seed + 97 * r, st.decode_batch)
        buffer = (buffer + got["states"])[-st.buffer :]
        info = {"round": r, "student": student or "base", "right": f"{got['right']}/{len(share)}"}
        info |= {"forwards_per_request": round(got["forwards"], 2), "new_states": len(got["states"])}
        info["rollout_s"] = round(time.time() - t1, 1)
        log(f"[round {r}] rollout: {info['right']} right, {info['forwards_per_request']} forwards/request")
        info.update(_train(peft_model, opt, params, buffer, bundle, st, gen, weights, log, r, loss_fn))
        where = st.out / f"round{r}"
        peft_model.save_pretrained(str(where))
        student = str(where)
        rounds.append(info)
        log(f"[round {r}] {json.dumps(info)}")
    peft_model.save_pretrained(str(st.out))
    report = {
        "model": bundle.spec,
        "decoder": "official",
        "init": str(st.init) if st.init else None,
        "rounds": rounds,
        "settings": settings_json(st),
        "total_seconds": round(time.time() - t0, 1),
    }
    (st.out / "adapt_report.json").write_text(json.dumps(report, indent=2, default=str))
    return report
