"""GPU probe: the host's cost of one launch, which bounds a testbed step on a GPU (its device work is
a few ms, its host work several): a torch op, a Triton kernel with 3 arguments and one with 20 (the
constraint kernels take 15-25), and the sampler's whole `softmax_sample` call at the testbed's
64-slot shape (4 Triton launches, a few torch ops and the top-k check's host sync), and the pieces of
a constrained step's host work that are not launches: a step's row columns ([10, 45] int32) to the
device through `to_device` (pinned on each call, then an async copy) against a kept ring of pinned
buffers, a small `torch.empty` (the Viterbi's wrapper makes six), and a 2-row read back to the host
(`SlotRules.read_with`'s, after its sync). Host µs a call:
N calls queued back to back after a warm-up, the wall up to the last call's return (before the sync
that ends them), over N; the device stays ahead of the queue for kernels this small. Outputs are
checked first (each kernel against torch).

    python benchmarks/probes/launch_cost_gpu.py              # H100 / H200
    python benchmarks/probes/launch_cost_gpu.py --quick      # CPU: interpreted, a few calls
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch
import triton
import triton.language as tl

from canvasq.kernels import softmax_sample
from canvasq.model.windows import to_device


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


@triton.jit
def _add_many(
    x_ptr, a_ptr, b_ptr, c_ptr, d_ptr, e_ptr, f_ptr, g_ptr, n,
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9,
    NEG: tl.constexpr, BLOCK: tl.constexpr, FLAG: tl.constexpr,
):  # fmt: skip
    # 20 arguments, as the constraint kernels take: pointers, ints and constexprs, the ints unused
    # but for a sum, so none is specialised away
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7 + s8 + s9
    v = tl.load(x_ptr + offs, mask=offs < n) + tl.load(a_ptr + offs, mask=offs < n)
    v = v + tl.load(b_ptr + offs, mask=offs < n) * 0.0 + (k * 0).to(tl.float32)
    if FLAG:
        v = tl.maximum(v, NEG)
    tl.store(x_ptr + offs, v, mask=offs < n)


def host_us(call, n: int) -> float:
    """Host µs a call: `n` calls queued back to back (after 3 warm-ups), the wall to the last return."""
    for _ in range(3):
        call()
    C.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    dt = time.perf_counter() - t0
    C.sync()
    return dt / n * 1e6


class PinnedRing:
    """Kept pinned buffers for small host-to-device copies, each reused once its last copy is done
    (an event a buffer): `to_device` pins a new buffer on every call."""

    def __init__(self, shape, dtype, dev, n: int = 8):
        pin = torch.device(dev).type == "cuda"
        self.bufs = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(n)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(n)]
        self.dst = torch.empty(shape, dtype=dtype, device=dev)
        self.k = 0

    def copy(self, host) -> torch.Tensor:
        buf, ev = self.bufs[self.k], self.events[self.k]
        self.k = (self.k + 1) % len(self.bufs)
        if ev is not None:
            ev.synchronize()  # its last copy is done (long ago, at a step's pace)
        buf.numpy()[...] = host
        self.dst.copy_(buf, non_blocking=True)
        if ev is not None:
            ev.record()
        return self.dst


def host_arms(dev) -> dict:
    """The constrained step's host pieces that are not launches (module docstring)."""
    import numpy as np

    cols = np.arange(10 * 45, dtype=np.int32).reshape(10, 45)
    ring = PinnedRing((10, 45), torch.int32, dev)
    assert torch.equal(ring.copy(cols).cpu(), torch.from_numpy(cols)), "the ring's copy"
    assert torch.equal(to_device(torch.from_numpy(cols), dev).cpu(), torch.from_numpy(cols)), "to_device"
    state = torch.zeros(64, 36, dtype=torch.long, device=dev)
    idx = [3, 17]
    head = torch.zeros(2, 32, dtype=torch.long, device=dev)
    return {
        "to_device, [10, 45] int32 (pinned each call)": lambda: to_device(torch.from_numpy(cols), dev),
        "kept pinned ring, [10, 45] int32": lambda: ring.copy(cols),
        "torch.empty [45, 32] int64": lambda: torch.empty(45, 32, dtype=torch.long, device=dev),
        "2 rows of [64, 36] read back (index, tolist)": lambda: state[to_device(idx, dev)].tolist(),
        # `SlotRules.read_with`'s read: the whole table after the stopped canvases' [2, 32] argmax
        "[2, 32] + whole [64, 36] read back (cat, one copy)": lambda: (
            torch.cat([head.reshape(-1), state.reshape(-1)]).cpu().numpy()[idx]
        ),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few calls (on CPU: interpreted)")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    n = 3 if a.quick else a.calls
    dev = C.DEVICE
    x = torch.zeros(1024, device=dev)
    others = [torch.zeros(1024, device=dev) for _ in range(7)]
    ints = list(range(1, 11))

    def add_one():
        _add_one[(1,)](x, 1024, BLOCK=1024)

    def add_many():
        _add_many[(1,)](x, *others, 1024, *ints, NEG=-1.0e9, BLOCK=1024, FLAG=True)

    # outputs: each kernel adds what torch adds
    ref = x.clone() + 1.0
    add_one()
    assert torch.equal(x, ref), "the 3-argument kernel"
    others[0].fill_(2.0)
    ref = x.clone() + 2.0
    add_many()
    assert torch.equal(x, ref), "the 20-argument kernel"

    rows, C_, V = 32 if a.quick else 64 * 32, 32, 748  # the testbed's 64-slot step: 2,048 rows of 748
    logits = torch.randn(rows, V, device=dev) * 4
    inv = torch.full((rows // C_ if rows >= C_ else 1,), 1.25, device=dev)
    seeds = torch.arange(inv.numel(), device=dev)
    group = rows // inv.numel()
    out = softmax_sample(logits, inv, seeds, group, top_k=64, impl="triton", draw="invcdf")
    assert torch.equal(out.argmax, logits.argmax(-1)), "the sampler's argmax"

    arms = {
        "torch add_ (1 launch)": lambda: x.add_(1.0),
        "Triton, 3 arguments (1 launch)": add_one,
        "Triton, 20 arguments (1 launch)": add_many,
        f"softmax_sample, {rows} x {V}, top-64, invcdf": lambda: softmax_sample(
            logits, inv, seeds, group, top_k=64, impl="triton", draw="invcdf"
        ),
    }
    arms |= host_arms(dev)
    res = {name: round(host_us(call, n), 1) for name, call in arms.items()}
    for name, us in res.items():
        print(f"{name:55s} {us:9.1f} µs a call (host)", flush=True)
    print(json.dumps({"bench": "launch_cost", "calls": n, "host_us": res}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "launch_cost.json"), "w") as f:
            json.dump({"bench": "launch_cost", **C.device_info(), "calls": n, "host_us": res}, f, indent=1)


if __name__ == "__main__":
    main()
