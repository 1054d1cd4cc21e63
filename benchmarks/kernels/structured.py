"""Structured output's per-step device work at the real shape (issue 36): a string-and-integer schema's
automaton over a synthetic vocabulary of the real size (262,144 token texts of 1–8 characters: the
real tokenizer cannot be downloaded here; a string slot takes nearly every token, so the edge count
E is close to V, as it would be with the real one), C = 256 positions, R constrained rows:

- `plan`: one canvas's [C, V] masks (`DeviceGrammar.plan`, once per canvas per row: built, or kept from
  an earlier canvas with the same state and budget);
- `mask`: the masked fill of R rows' logits (`CanvasConstraints.mask` without the pin);
- `best`: the batched Viterbi of R rows (`DeviceGrammar.best`: the pin's check every step, and each
  stopped canvas's final tokens), from their log-probs; `best, no classes` (GPU): the same kernel with
  the free-text pair's tokens as edges of their own (`kernels.viterbi.csr` without classes), and
  whether its paths are `best`'s;
- `host best` (small R only): `Grammar.best` per row after copying the log-probs to the host, the
  path this replaced;
- `testbed best` / `testbed best, torch twin`: the Viterbi of 64 rows at the testbed's shape (its
  tokenizer, C = 32) for the three composite schemas of `benchmarks/structured_output.py` thinking first
  (the eval's automata: Q 32, 58, 163), and whether the two give the same paths.

GPU: python benchmarks/kernels/structured.py   CPU: python benchmarks/kernels/structured.py --quick
"""

from __future__ import annotations

import argparse
import string
import time

import _common as C
import numpy as np
import torch

from canvasq.decoders.grammar_device import DeviceGrammar
from canvasq.decoders.structured import TokenTexts, compile_grammar

SCHEMA = {
    "type": "object",
    "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
    "required": ["reasoning", "answer"],
    "additionalProperties": False,
}


def synthetic_texts(V: int, seed: int = 0) -> TokenTexts:
    """V token texts: every single character, then distinct random strings (half with a leading
    space); the last two ids are EOS and PAD."""
    rng = np.random.default_rng(seed)
    alphabet = list(string.ascii_letters + string.digits + " .,:;!?'-()\"{}[]#=+*/")
    texts, seen = list(alphabet), set(alphabet)
    while len(texts) < V - 2:
        t = "".join(rng.choice(alphabet, size=int(rng.integers(2, 9))))
        t = " " + t if rng.random() < 0.5 else t
        if t not in seen:
            seen.add(t)
            texts.append(t)
    return TokenTexts((*texts, None, None), V - 2, V - 1)


def wall_ms(fn, reps: int = 3) -> float:
    """Median wall ms of `fn()` (host work and syncs included, as the decoder sees it)."""
    fn()
    times = []
    for _ in range(reps):
        C.sync()
        t0 = time.perf_counter()
        fn()
        C.sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times))


def measure(dg: DeviceGrammar, R: int, Cn: int, V: int, budget: int) -> list[dict]:
    g = dg.g
    dtype = torch.bfloat16 if C.ON_GPU else torch.float32
    logits = torch.randn(R, Cn, V, device=C.DEVICE, dtype=dtype)
    masks = dg.plan(g.start, Cn, budget, V).expand(R, Cn, V)
    out = [{"part": "mask", "R": R, "ms": wall_ms(lambda: logits.float().masked_fill(~masks, -1e9))}]
    logp = torch.log_softmax(logits.float(), dim=-1)
    out.append({"part": "best", "R": R, "ms": wall_ms(lambda: dg.best([g.start] * R, logp, [budget] * R))})
    if C.ON_GPU:  # the same walk with every free-text token its own edge (no classes), same process
        rows, back = torch.arange(R, device=C.DEVICE), torch.stack([dg.back(Cn, budget)] * R)

        def whole():
            return dg._best_kernel([g.start] * R, logp, rows, back, class_min=1 << 40)

        out.append({"part": "best, no classes", "R": R, "ms": wall_ms(whole)})
        toks, _ = dg.best([g.start] * R, logp, [budget] * R)
        out[-1]["same paths"] = sum(a == b for a, b in zip(whole()[0].tolist(), toks.tolist()))
    if R <= 2:

        def host_best():
            lp = logp.cpu().numpy().astype(np.float64)  # the copy the old path made every step
            return [g.best(g.start, lp[r], budget)[0] for r in range(R)]

        out.append({"part": "host best (copy + numpy)", "R": R, "ms": wall_ms(host_best, reps=1)})
        toks, _ = dg.best([g.start] * R, logp, [budget] * R)
        out[-1]["same paths"] = sum(a == b for a, b in zip(host_best(), toks.tolist()))
    return out


def measure_testbed(R: int = 64, Cn: int = 32) -> list[dict]:
    """`best` (on CUDA the kernel) against its torch twin at the testbed's shape, per composite schema."""
    from canvasq.decoders.structured import cached_grammar, token_texts
    from canvasq.model.loading import DEFAULT_MODEL_DIR
    from canvasq.testbed.json_adapter import FORM_SCHEMAS

    texts = token_texts(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    out: list[dict] = []
    for name in ("answer", "answer_change", "answer_totals"):
        dg = DeviceGrammar(cached_grammar(FORM_SCHEMAS[name], texts, True), torch.device(C.DEVICE))
        out += testbed_rows(name, dg, R, Cn, len(texts.texts))
    return out


def testbed_rows(name: str, dg: DeviceGrammar, R: int, Cn: int, V: int) -> list[dict]:
    """One schema's `measure_testbed` rows: random logits, every row from the start state."""
    g, budget = dg.g, 6 * Cn
    logits = torch.randn(R, Cn, V, device=C.DEVICE) * 3
    back = torch.stack([dg.back(Cn, budget)] * R)
    rows = torch.arange(R, device=C.DEVICE)
    toks, _ = dg.best([g.start] * R, logits, [budget] * R)
    twin, _ = dg._best_torch([g.start] * R, logits, rows, back)
    common = {"schema": f"{name} (Q {g.Q}, E {len(g.src)})", "R": R}
    return [
        {
            "part": "testbed best",
            **common,
            "ms": wall_ms(lambda: dg.best([g.start] * R, logits, [budget] * R), 10),
            "same paths": sum(a == b for a, b in zip(toks.tolist(), twin.tolist())),
        },
        {
            "part": "testbed best, torch twin",
            **common,
            "ms": wall_ms(lambda: dg._best_torch([g.start] * R, logits, rows, back)),
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU)")
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--rows", default="1,16,64")
    args = ap.parse_args()
    V, Cn = (4096, 32) if args.quick else (args.vocab, 256)
    row_counts = [2] if args.quick else [int(r) for r in args.rows.split(",")]
    t0 = time.perf_counter()
    g = compile_grammar(SCHEMA, synthetic_texts(V))
    compile_s = time.perf_counter() - t0
    dg = DeviceGrammar(g, torch.device(C.DEVICE))
    budget = 4 * Cn
    rows = [
        {"part": "plan (one canvas, built)", "R": 1, "ms": wall_ms(lambda: dg._plan(g.start, Cn, budget, V))},
        {"part": "plan (one canvas, kept)", "R": 1, "ms": wall_ms(lambda: dg.plan(g.start, Cn, budget, V))},
    ]
    for R in row_counts:
        rows += measure(dg, R, Cn, V, budget)
    rows += measure_testbed(16 if args.quick else 64)
    C.report(
        "structured",
        rows,
        ["part", "schema", "R", "ms", "same paths"],
        {
            **C.device_info(),
            "V": V,
            "C": Cn,
            "Q": g.Q,
            "E": len(g.src),
            "compile_s": compile_s,
            "correct": all(r["same paths"] == r["R"] for r in rows if "same paths" in r),
        },
    )


if __name__ == "__main__":
    main()
