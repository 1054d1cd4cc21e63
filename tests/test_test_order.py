"""The order `tests/conftest.py` gives xdist's worksteal blocks: every test kept once, blocks the size
worksteal cuts them, each block's share of the measured time even, a module's tests together."""

from dataclasses import dataclass
from itertools import groupby

from tests.conftest import balanced


@dataclass(frozen=True)
class _Item:
    nodeid: str
    seconds: float


def test_blocks_are_worksteal_sized_even_and_keep_modules_together():
    items = [_Item(f"tests/slow_{m}.py::t{i}", 60.0 - 9 * i) for m in range(2) for i in range(6)]
    items += [_Item(f"tests/fast_{m}.py::t{i}", 0.3) for m in range(5) for i in range(37)]
    out = balanced(items, 6, lambda it: it.seconds)
    assert sorted(out, key=id) == sorted(items, key=id)
    blocks, left, start = [], len(out), 0
    for i in range(6):  # worksteal: node i first gets pending // (nodes left) of what remains
        size = left // (6 - i)
        blocks.append(out[start : start + size])
        start, left = start + size, left - size
    loads = [sum(it.seconds for it in b) for b in blocks]
    assert max(loads) - min(loads) <= max(it.seconds for it in items)
    naive = [sum(it.seconds for it in items[k * 34 : (k + 1) * 34]) for k in range(6)]
    assert max(loads) < max(naive) / 2  # collection order would give one block both slow modules
    for b in blocks:  # each module's tests in one run per block (its module fixtures start once)
        runs = [m for m, _ in groupby(it.nodeid.split("::")[0] for it in b)]
        assert len(runs) == len(set(runs)), runs
