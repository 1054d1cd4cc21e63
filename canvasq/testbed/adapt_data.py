"""`canvasq adapt`'s data (testbed/adapt.py trains on it): the teacher's answers and the student's own
decoding states.

- **Teacher** (`teacher_answers`): the model itself with the adapter off, decoding with the official
  sampler prompts of the **train** split (`tasks.generate(..., split="train")`, never a dev or eval
  problem); an answer is kept only when the task's checker (`tasks.verify`) says it is right.
- **Student states** (`rollout`): pipe and Funnel decode those prompts with the student adapter, as
  they do in service, through a recording subclass that snapshots a row's live canvases just before
  each step's update (`_apply`): the input ids each canvas rode with (argmax drafts, frozen commits
  under `front="commit"`), which positions are still open, and the self-conditioning input the decoder
  really fed (pipe: its full logits; Funnel: the top-64 projection, kept as logits with every other
  entry at -inf, which softmaxes to the same renormalised distribution). A row's states are kept while
  its retired canvases equal the teacher's answer, so the target of every open position is the
  teacher's token at that position (after the teacher's EOS: pad, as the sampler writes).
- **Batches** (`collate`): context = prompt ‖ the teacher's answer before the front canvas (left
  padded, as `train_loss.encode_context` takes it), window = the K live canvases (block-causal), a
  `noise_share` of rows with the front canvas replaced by uniform noise (no self-conditioning, every
  position open: a canvas's first step).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from canvasq.testbed import tasks


@dataclass
class Teacher:
    """One verified teacher answer: its problem, prompt ids and answer ids through EOS."""

    problem: Any  # tasks.Problem
    prompt: list[int]
    answer: list[int]  # the result's ids (they stop before the stop token) and EOS where it stopped
    max_tokens: int

    @property
    def uid(self) -> str:
        return str(self.problem.uid)


@dataclass
class State:
    """One row's live canvases at one step (CPU tensors; K canvases of C positions, R = K·C)."""

    ctx: torch.Tensor  # [L] long: prompt ‖ the teacher's answer before the front canvas
    tokens: torch.Tensor  # [R] long: the ids the canvases rode with
    target: torch.Tensor  # [R] long: the teacher's tokens there
    train: torch.Tensor  # [R] bool: open positions (the loss covers these)
    sc: torch.Tensor | None  # [R, V] float16 self-conditioning logits (-inf outside a top-k), or None
    sc_rows: torch.Tensor  # [R] bool: rows that had self-conditioning

    @property
    def k(self) -> int:
        return int(self.tokens.numel())


def full_answer(t: Teacher, length: int, pad_id: int) -> list[int]:
    """The teacher's answer padded with `pad_id` to `length` positions."""
    return (t.answer + [pad_id] * length)[:length]


def teacher_answers(
    bundle, task: str, n: int, seed: int, batch_size: int, log: Callable[[str], None]
) -> tuple[list[Teacher], int]:
    """`n` train-split problems of `task` decoded by the official sampler on the plain weights; returns
    (the verified answers, problems tried)."""
    from canvasq.decoders import run_batch
    from canvasq.decoders.types import DecodeBatch, DecodeRequest

    problems = tasks.generate(task, n, seed, split="train")
    max_tokens = tasks.ANSWER_CANVASES[task] * bundle.canvas_length
    kept: list[Teacher] = []
    for start in range(0, n, batch_size):
        chunk = problems[start : start + batch_size]
        reqs = [
            DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, p.task), max_tokens, p.task) for p in chunk
        ]
        results = run_batch(bundle, DecodeBatch(reqs, seed=seed * 7919 + start), "official")
        for p, req, r in zip(chunk, reqs, results):
            if r.error is None and tasks.verify(p, r.text):
                answer = list(r.token_ids) + ([bundle.eos_id] if r.finish_reason == "stop" else [])
                kept.append(Teacher(p, req.prompt_ids, answer, max_tokens))
        log(f"[teacher] {task}: {len(kept)} verified of {min(start + batch_size, n)}")
    return kept, n


def recording_decoder(
    name: str, bundle, overrides: dict, teachers: dict[str, Teacher], keep: float, seed: int
):
    """A pipe or Funnel decoder (`name`) with `overrides` that appends a `State` to `.states` for a
    `keep` share of its rows' steps (module docstring)."""
    from canvasq.decoders.registry import decoder_class, make_config

    base = decoder_class(name)
    config = make_config(name, overrides)

    class Recording(base):  # type: ignore[misc, valid-type]
        def _apply(self, s, parts, out, b):
            self.snapshot(s)
            return super()._apply(s, parts, out, b)

        def snapshot(self, s) -> None:
            if self.rng.random() >= self.keep or not s.canvases:
                return
            t = self.teachers[s.req.custom_id]
            C, lead = self.C, s.canvases[0].start - s.prompt_len
            full = full_answer(t, lead + len(s.canvases) * C, self.bundle.pad_id)
            if s.out != full[: len(s.out)] or lead != len(s.out):
                return  # the row left the teacher's answer: no target for what follows
            self.states.append(_state(s, full, lead, self.rt.vocab_size))

    dec = Recording(bundle, config)
    dec.teachers, dec.keep, dec.rng, dec.states = teachers, keep, random.Random(seed), []
    return dec


def _state(s, full: list[int], lead: int, vocab: int) -> State:
    cvs = s.canvases
    R = sum(cv.length for cv in cvs)
    sc = None
    sc_rows = torch.zeros(R, dtype=torch.bool)
    if any(cv.sc is not None for cv in cvs):
        parts, off = [], 0
        for cv in cvs:
            dense = torch.zeros(cv.length, vocab)
            if cv.sc is not None:
                buf, have = cv.sc
                if isinstance(buf, tuple):  # top-k: (ids, logits)
                    dense = torch.full((cv.length, vocab), float("-inf"))
                    dense.scatter_(1, buf[0].cpu(), buf[1].float().cpu())
                    dense[~have.cpu()] = 0.0
                else:
                    dense = buf.float().cpu()
                sc_rows[off : off + cv.length] = have.cpu()
            parts.append(dense)
            off += cv.length
        sc = torch.cat(parts).to(torch.float16)
    return State(
        ctx=torch.tensor(list(s.req.prompt_ids) + full[:lead], dtype=torch.long),
        tokens=torch.cat([cv.tokens for cv in cvs]).cpu().clone(),
        target=torch.tensor(full[lead : lead + R], dtype=torch.long),
        train=torch.cat([~cv.committed for cv in cvs]).cpu().clone(),
        sc=sc,
        sc_rows=sc_rows,
    )


def rollout(
    bundle,
    teachers: list[Teacher],
    arm: tuple[str, dict],
    keep: float,
    seed: int,
    batch_size: int,
) -> tuple[list[State], int]:
    """Decode the teachers' prompts with one arm (decoder name, overrides); returns (the states it
    recorded, how many of its answers were right)."""
    from canvasq.decoders.types import DecodeBatch, DecodeRequest

    by_uid = {t.uid: t for t in teachers}
    dec = recording_decoder(arm[0], bundle, arm[1], by_uid, keep, seed)
    right = 0
    for start in range(0, len(teachers), batch_size):
        chunk = teachers[start : start + batch_size]
        reqs = [DecodeRequest(t.uid, t.prompt, t.max_tokens, t.problem.task) for t in chunk]
        results = dec.decode(DecodeBatch(reqs, seed=seed * 104_729 + start))
        right += sum(r.error is None and tasks.verify(t.problem, r.text) for t, r in zip(chunk, results))
    return dec.states, right


@dataclass
class Batch:
    ctx: torch.Tensor  # [B, L] long, left padded
    ctx_mask: torch.Tensor  # [B, L] bool
    tokens: torch.Tensor  # [B, K·C] long
    target: torch.Tensor  # [B, K·C] long
    train: torch.Tensor  # [B, K·C] bool
    sc: torch.Tensor | None  # [B, K·C, V] float32
    sc_rows: torch.Tensor  # [B, K·C] bool
    k: int

    def to(self, device) -> Batch:
        """The batch's tensors on `device` (the student's: collate builds on the CPU)."""
        moved = {f: getattr(self, f) for f in ("ctx", "ctx_mask", "tokens", "target", "train", "sc_rows")}
        moved = {f: t.to(device, non_blocking=True) for f, t in moved.items()}
        sc = self.sc.to(device, non_blocking=True) if self.sc is not None else None
        return replace(self, sc=sc, **moved)


def collate(
    states: list[State], canvas: int, vocab: int, pad_id: int, noise_share: float, gen: torch.Generator
) -> Batch:
    """States as one batch (module docstring); K = the most canvases among them, fewer padded with
    `pad_id` rows outside the loss (block-causal: no earlier canvas sees them)."""
    B = len(states)
    R = max(st.k for st in states)
    L = max(int(st.ctx.numel()) for st in states)
    ctx = torch.full((B, L), pad_id, dtype=torch.long)
    ctx_mask = torch.zeros(B, L, dtype=torch.bool)
    tokens = torch.full((B, R), pad_id, dtype=torch.long)
    target = torch.full((B, R), pad_id, dtype=torch.long)
    train = torch.zeros(B, R, dtype=torch.bool)
    sc_rows = torch.zeros(B, R, dtype=torch.bool)
    sc = torch.zeros(B, R, vocab) if any(st.sc is not None for st in states) else None
    noised = torch.rand(B, generator=gen) < noise_share
    for i, st in enumerate(states):
        n, r = int(st.ctx.numel()), st.k
        ctx[i, L - n :], ctx_mask[i, L - n :] = st.ctx, True
        tokens[i, :r], target[i, :r], train[i, :r] = st.tokens, st.target, st.train
        if st.sc is not None and sc is not None:
            sc[i, :r], sc_rows[i, :r] = st.sc.float(), st.sc_rows
        if noised[i]:  # the front's first step: uniform noise, no self-conditioning, all open
            tokens[i, :canvas] = torch.randint(0, vocab, (canvas,), generator=gen)
            train[i, :canvas], sc_rows[i, :canvas] = True, False
            tokens[i, canvas:], train[i, canvas:], sc_rows[i, canvas:] = pad_id, False, False
    if sc is not None:
        sc[~sc_rows] = 0.0  # rows without SC: finite logits (their signal is zeroed in the forward)
    return Batch(ctx, ctx_mask, tokens, target, train, sc, sc_rows, R // canvas)
