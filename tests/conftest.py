"""Settings every test directory shares (each directory's own conftest adds its fixtures)."""

import os
from pathlib import Path

# oneDNN's AMX / AVX512-FP16 kernels (newer Xeons) round fp16 matmuls differently from the AVX-512
# ones: on such a CPU the runtime's fp16 logits (interpreted attention kernel) moved by 8 % against
# HF's, 2 % being the bound, and pass with this setting. The tolerances are set for the AVX-512 kernels,
# so every run uses them (read at oneDNN's first primitive; worker processes inherit it).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")

# Under pytest-xdist (the README's `-n 6` on CI's 2 cores) every test process and the processes it
# starts run torch on one thread: four workers each spinning two OpenMP threads oversubscribed the
# cores (a 39 s benchmark dry run took 440 s in CI). Set before torch is imported anywhere.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


# Balanced blocks for the README's `-n 6 --dist worksteal`: worksteal hands worker i the i-th contiguous
# block of the collection (block i holds remaining // (n - i) items) and an idle worker later steals the
# second half of the longest queue. So each block gets an even share of the measured test time (largest
# first to the lightest block with room, LPT), its modules in order of their time there, longest first,
# each module's tests together and in file order (module fixtures start once per block). What is
# stolen at the end is the short tail. Seconds per test: `durations.tsv` (wall seconds of a CI-like
# run, `scripts/test_durations.py`); a test not in it counts as SLOW_S when marked slow, else FAST_S.
# Order only: every test runs either way.
DURATIONS = Path(__file__).with_name("durations.tsv")
SLOW_S, FAST_S = 10.0, 0.3


def _measured() -> dict[str, float]:
    if not DURATIONS.is_file():
        return {}
    rows = (line.split("\t", 1) for line in DURATIONS.read_text().splitlines() if line.strip())
    return {node: float(sec) for sec, node in rows}


def balanced(items: list, n: int, weight) -> list:
    """`items` as n contiguous blocks of near-equal `weight` (see above)."""
    sizes, left = [], len(items)
    for i in range(n):
        sizes.append(left // (n - i))
        left -= sizes[-1]
    blocks: list[list] = [[] for _ in range(n)]
    load = [0.0] * n
    for item in sorted(items, key=weight, reverse=True):  # stable: ties keep collection order
        i = min((j for j in range(n) if len(blocks[j]) < sizes[j]), key=lambda j: load[j])
        blocks[i].append(item)
        load[i] += weight(item)
    index = {id(item): k for k, item in enumerate(items)}
    out = []
    for block in blocks:
        per_module: dict[str, float] = {}
        for item in block:
            per_module[_module(item)] = per_module.get(_module(item), 0.0) + weight(item)
        out += sorted(block, key=lambda it: (-per_module[_module(it)], _module(it), index[id(it)]))
    return out


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if n < 2:
        return
    measured = _measured()

    def weight(item) -> float:
        default = SLOW_S if item.get_closest_marker("slow") is not None else FAST_S
        return measured.get(item.nodeid, default)

    items[:] = balanced(items, n, weight)


# CANVASQ_TEST_CPU=FILE: append "cpu<TAB>start<TAB>end<TAB>worker<TAB>nodeid" per test: the CPU seconds
# (user + system) its process and the children it waited for used, and its wall-clock span, to find
# what CI's 2 cores spend and which tests make the tail (a CI-time tool; off by default).
if os.environ.get("CANVASQ_TEST_CPU"):
    import resource
    import time

    import pytest

    def _cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, t0 = _cpu(), time.time()
        try:
            return (yield)
        finally:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
            with open(os.environ["CANVASQ_TEST_CPU"], "a") as f:
                f.write(f"{_cpu() - start:.2f}\t{t0:.1f}\t{time.time():.1f}\t{worker}\t{item.nodeid}\n")
