"""`canvasq adapt`: a D2F adapter trained by self-distillation on the decoders' own states (issue 35,
item 2).

Teacher: the model itself with the adapter off, its official-sampler answers to train-split prompts
kept when verified (testbed/adapt_data.py). Student: a LoRA on the decoder's attention and MLP
projections (the encoder keeps the base weights, as pipe and Funnel run it with `adapter_encoder`
off), started from the model's own `d2f_adapter/` unless told otherwise. A few DAgger-style rounds:

1. **rollout**: pipe and Funnel (each arm of `arms`) decode a fresh share of the teachers' prompts
   with the current student and record their states (argmax drafts, frozen commits, the
   self-conditioning each feeds; adapt_data.py); the states join a replay buffer;
2. **train** for the round's share of the time budget on batches from the buffer: cross-entropy to
   the teacher's tokens on the open positions (digits weighted up, as train.py does; with
   `target="logits"` the front canvas learns the teacher's distribution on the same state instead, with
   `"mixed"` only where the teacher finds the answer's token implausible), plus a
   calibration term on the open positions whose argmax is wrong: −log(1 − p(argmax)) where
   p(argmax) ≥ τ, the confidence that would commit or accept a wrong token;
3. save the round's adapter; the next round rolls out with it.

Output: `<out>/` is a peft adapter directory (the format of `<model>/d2f_adapter/`) with
`adapt_report.json` and `adapt_log.txt`; decoders take it with `adapter_path=<out>` (decoders/adapters.py).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from canvasq.testbed.adapt_data import Batch, State, Teacher, collate, rollout, teacher_answers
from canvasq.testbed.train_loss import _decoder_kwargs, digit_weights, encode_context

# Decoder modules only (train.py's adapter): encoder and decoder share weight tensors, so a merge
# reaches both, and pipe / Funnel run the encoder on the base weights anyway.
TARGETS = r".*decoder\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
DEFAULT_ARMS: tuple[tuple[str, dict], ...] = (
    ("pipe", {"front": "revise"}),
    ("funnel", {"front": "revise", "retire_refresh": True}),
    ("pipe", {}),  # today's rule: frozen commits in the window
)


@dataclass
class AdaptSettings:
    out: Path
    init: Path | None = None  # adapter to continue; None: a fresh LoRA (zero delta: the base model)
    tasks: tuple[str, ...] = ("arith", "code")
    teacher_n: int = 256  # train-split problems per task the teacher decodes
    seed: int = 35
    rounds: int = 3
    minutes: float = 20.0  # training wall time over all rounds (rollouts and the teacher not counted)
    max_steps: int | None = None  # a step cap per round (tests)
    batch: int = 32
    lr: float = 5e-4
    rank: int = 16
    tau: float = 0.7  # the calibration term's bar (Funnel's τ_conf; pipe's 0.9 is above it)
    calibration_weight: float = 1.0
    noise_share: float = 0.15
    keep: float = 0.5  # share of a row's steps recorded
    decode_batch: int = 16
    buffer: int = 12_000  # states kept (the oldest leave first)
    arms: tuple[tuple[str, dict], ...] = DEFAULT_ARMS
    # what the front canvas's open positions learn: "tokens", the teacher's verified answer; "logits",
    # the teacher's distribution on the same state (the model with the adapter off: official's
    # denoiser), which keeps every token the canvas already implies (a code answer's names) where the
    # answer's tokens would pull toward one spelling; "mixed", per position: the answer's token where
    # the teacher gives it at least `answer_floor` on that state (an arithmetic's digits, names the
    # canvas has not contradicted), the teacher's distribution where it does not (a name the state has
    # already chosen otherwise). Canvases behind the front keep the tokens.
    target: str = "tokens"
    answer_floor: float = 0.05
    # "d2f": the adapter pipe and Funnel decode with (above); "official": certainty distillation for
    # the native sampler on its own verified trajectories (testbed/certainty.py)
    decoder: str = "d2f"
    certainty_weight: float = 0.5  # "official": weight of the entropy term on already-right positions
    rounds_log: list = field(default_factory=list)


def adapt(bundle, st: AdaptSettings, log: Callable[[str], None]) -> dict:
    """Train the adapter (module docstring); returns the report also written to `<out>/adapt_report.json`."""
    t0 = time.time()
    out = st.out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(st.seed)
    teachers: list[Teacher] = []
    tried = 0
    for i, task in enumerate(st.tasks):
        kept, n = teacher_answers(bundle, task, st.teacher_n, st.seed * 1_000 + i, st.decode_batch, log)
        teachers += kept
        tried += n
    if not teachers:
        raise RuntimeError("the teacher answered none of its problems correctly: nothing to distil")
    random.Random(st.seed).shuffle(teachers)
    t_teacher = time.time() - t0
    log(f"[teacher] {len(teachers)} verified of {tried} in {t_teacher:.0f}s")

    peft_model = _student(bundle, st)
    params, opt = optimiser(peft_model, st)
    device = next(peft_model.parameters()).device  # the bundle's: states stay on the CPU until a batch
    weights = digit_weights(bundle.tokenizer, bundle.config.text_config.vocab_size, 4.0, device)
    buffer: list[State] = []
    student = str(st.init) if st.init else None
    rounds = []
    for r in range(st.rounds):
        share = teachers[r :: st.rounds] if len(teachers) >= st.rounds else teachers
        t1 = time.time()
        info: dict = {"round": r, "prompts": len(share), "student": student or "base"}
        for j, (name, over) in enumerate(st.arms):
            arm_over = {**over, **({"adapter_path": student} if student else {"adapter": False})}
            states, right = rollout(
                bundle, share, (name, arm_over), st.keep, st.seed + 97 * r + j, st.decode_batch
            )
            buffer += states
            label = name + (":" + ",".join(f"{k}={v}" for k, v in over.items()) if over else "")
            info[f"right {label}"] = f"{right}/{len(share)}"
            log(f"[round {r}] rollout {label}: {right}/{len(share)} right, {len(states)} states")
        buffer = buffer[-st.buffer :]
        info["rollout_s"] = round(time.time() - t1, 1)
        info.update(_train(peft_model, opt, params, buffer, bundle, st, gen, weights, log, r))
        where = out / f"round{r}"
        peft_model.save_pretrained(str(where))
        student = str(where)
        rounds.append(info)
        log(f"[round {r}] {json.dumps(info)}")
    peft_model.save_pretrained(str(out))
    report = {
        "model": bundle.spec,
        "init": str(st.init) if st.init else None,
        "teacher": {"verified": len(teachers), "tried": tried, "seconds": round(t_teacher, 1)},
        "rounds": rounds,
        "settings": settings_json(st),
        "total_seconds": round(time.time() - t0, 1),
    }
    (out / "adapt_report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def _student(bundle, st: AdaptSettings):
    """A trainable peft LoRA over an fp32 copy of the base weights: continued from `st.init`, else fresh."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    base = copy.deepcopy(bundle.hf_model).float()
    if st.init:
        model = PeftModel.from_pretrained(base, str(st.init), is_trainable=True)
    else:
        lora = LoraConfig(r=st.rank, lora_alpha=2 * st.rank, lora_dropout=0.0, target_modules=TARGETS)
        model = get_peft_model(base, lora)
    if hasattr(base, "set_experts_implementation") and str(bundle.device).startswith("cpu"):
        base.set_experts_implementation("eager")  # ~5x faster than grouped_mm's fallback on the CPU
    model.train()
    return model


def optimiser(peft_model, st: AdaptSettings):
    """(the LoRA's trainable parameters, their AdamW at `st.lr`)."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    return params, torch.optim.AdamW(params, lr=st.lr, weight_decay=0.0, betas=(0.9, 0.98))


def settings_json(st: AdaptSettings) -> dict:
    """`st` as the report writes it (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(st).items() if k != "rounds_log"}


def decoder_inputs(model, batch: Batch, canvas: int) -> dict:
    """The decoder's keyword inputs for `batch`'s windows after its context's cache (the encoder has no
    LoRA: its cache needs no gradient)."""
    with torch.no_grad():
        cache = encode_context(model, batch.ctx, batch.ctx_mask)
    return _decoder_kwargs(model, batch.ctx_mask, batch.tokens, cache, batch.k, canvas)


def _train(peft_model, opt, params, buffer, bundle, st, gen, weights, log, r: int, loss_fn=None) -> dict:
    """One round's training: cosine-decayed AdamW steps for `minutes / rounds` (or `max_steps`).
    `loss_fn(model, batch) -> (loss, part, part)`: the objective (default: `adapt_loss` by `st`)."""
    model = peft_model.base_model.model
    budget = st.minutes * 60 / st.rounds
    groups: dict[int, list[State]] = {}
    for s in buffer:
        groups.setdefault(s.k, []).append(s)
    sizes = torch.tensor([len(g) for g in groups.values()], dtype=torch.float)
    keys = list(groups)
    t0, step, ema, first = time.time(), 0, None, None
    C, V = bundle.canvas_length, bundle.config.text_config.vocab_size
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1 or (st.max_steps is not None and step >= st.max_steps):
            break
        for g in opt.param_groups:
            g["lr"] = st.lr * min(1.0, (step + 1) / 20) * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * frac)))
        group = groups[keys[int(torch.multinomial(sizes, 1, generator=gen))]]
        pick = torch.randint(0, len(group), (st.batch,), generator=gen).tolist()
        batch = collate([group[i] for i in pick], C, V, bundle.pad_id, st.noise_share, gen).to(weights.device)
        if loss_fn is not None:
            loss, ce, cal = loss_fn(model, batch)
        else:
            teacher = peft_model.disable_adapter if st.target in ("logits", "mixed") else None
            floor = st.answer_floor if st.target == "mixed" else None
            loss, ce, cal = adapt_loss(
                model, batch, C, st.tau, st.calibration_weight, weights, teacher, floor
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        first = value if first is None else first
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        if step % 25 == 0:
            term = "cal" if loss_fn is None else "aux"
            log(
                f"[round {r}] step {step} loss {ema:.4f} (ce {ce:.4f} {term} {cal:.4f}) {time.time() - t0:.0f}s"
            )
    return {
        "states": len(buffer),
        "steps": step,
        "train_s": round(time.time() - t0, 1),
        "first_loss": round(float(first or 0.0), 4),
        "final_loss": round(float(ema or 0.0), 4),
    }


def adapt_loss(
    model,
    batch: Batch,
    canvas: int,
    tau: float,
    cal_weight: float,
    token_weight=None,
    teacher=None,
    answer_floor: float | None = None,
):
    """(loss, its distillation part, its calibration part) on one batch (module docstring). `model`:
    the HF model with the LoRA layers in it (peft's `base_model.model`). `teacher`: a context under
    which `model` runs without the adapter (peft's `disable_adapter`); given, the front canvas's open
    positions learn the teacher's distribution there (KL, zero where the student already matches) and
    "wrong" means off the teacher's argmax; the other positions keep the teacher's tokens. With
    `answer_floor` too, a front position whose answer token has at least that teacher probability keeps
    the answer's token instead (`AdaptSettings.target` "mixed")."""
    kw = decoder_inputs(model, batch, canvas)
    with _sc_rows(model, batch.sc_rows if batch.sc is not None else None):
        logits = model(**kw, self_conditioning_logits=batch.sc).logits.float()
        if teacher is not None:
            with torch.no_grad(), teacher():
                t_logp = torch.log_softmax(model(**kw, self_conditioning_logits=batch.sc).logits.float(), -1)
    target, train = batch.target, batch.train
    logp = torch.log_softmax(logits, -1)  # one pass over the vocabulary for every term below
    per = -logp.gather(-1, target[..., None])[..., 0]  # cross-entropy to the teacher's tokens
    if teacher is not None:
        distil = torch.zeros_like(train)  # the front canvas's positions that learn the distribution
        distil[:, :canvas] = True
        if answer_floor is not None:  # except where the teacher finds the answer's token plausible
            distil &= t_logp.gather(-1, target[..., None])[..., 0] < math.log(answer_floor)
        kl = (t_logp.exp() * (t_logp - logp)).sum(-1)
        per = torch.where(distil, kl, per)
        target = torch.where(distil, t_logp.argmax(-1), target)
    w = train.float()
    if token_weight is not None:
        w = w * token_weight[target]
    ce_mean = (per * w).sum() / w.sum().clamp_min(1.0)
    lmax, arg = logp.max(dim=-1)
    pmax = lmax.exp()
    over = train & (arg != target) & (pmax >= tau)
    cal = -(torch.log1p(-pmax.clamp(max=1 - 1e-6)) * over).sum() / train.sum().clamp_min(1)
    return ce_mean + cal_weight * cal, float(ce_mean.detach()), float(cal.detach())


class _sc_rows:
    """While active, the decoder's self-conditioning signal is zeroed on the rows that had none (the
    decoders give SC per row; HF's `self_conditioning_mask` is per example)."""

    def __init__(self, model, rows: torch.Tensor | None) -> None:
        self.rows, self.handle = rows, None
        self.module = next(m for n, m in model.named_modules() if n.endswith("decoder.self_conditioning"))

    def __enter__(self):
        if self.rows is not None:
            mask = self.rows[..., None]

            def hook(_mod, args):
                emb, sig = args
                return emb, sig * mask.to(sig.dtype)

            self.handle = self.module.register_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.remove()
