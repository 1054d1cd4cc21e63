"""The grouped GEMM's tilings (`Tiles`) and where they come from: a device's tuned file, written by
`benchmarks/kernels/fp8_grouped.py`'s sweep and checked in under `moe/configs`, or the untuned rule."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .moe.config import nearest_at_or_above


@dataclass(frozen=True)
class Tiles:
    """One launch's blocking; `imprecise`: FP8 products summed in the tensor core's own accumulator
    for that many K elements before an fp32 add (torch's `use_fast_accum` is the whole K)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    warps: int = 4
    stages: int = 4
    imprecise: int | None = None
    tma: bool = False  # operands through Hopper's tensor memory accelerator (descriptors) or pointers
    m_major: bool = False  # the launch order: row tiles outer (`_tile_of`)
    # programs an SM that each loop over tiles, the next tile's loads issued while this one's epilogue
    # runs (0: one tile a program, the launch's grid all the tiles)
    persistent: int = 0


def tiles_for(
    rows: int, experts: int, n: int = 0, k: int = 0, gated: bool = False, device: str = ""
) -> Tiles:
    """The tiling of one launch: the tuned file's (`tuned_file`) for this GEMM at the nearest row count
    at or above `rows` (else its largest), or without one: 64-row tiles while an expert holds about that
    many rows (the weights' bytes bound the GEMM there), 128 beyond; a gated launch's column tile is
    each half's, so half as wide."""
    return _tiles_for(
        rows, experts, n, k, gated, os.environ.get(TUNED_ENV) or str(tuned_file(experts, device))
    )


@functools.lru_cache(maxsize=256)
def _tiles_for(rows: int, experts: int, n: int, k: int, gated: bool, path: str) -> Tiles:
    table = load_tuned(path).get(gemm_key(n, k, gated))
    if table:
        return nearest_at_or_above(table, rows)
    block_n = 64 if gated else 128
    if rows <= 96 * experts:
        return Tiles(64, block_n, 128, warps=4, stages=4)
    return Tiles(128, block_n, 128, warps=8, stages=4)


TUNED_ENV = "CANVASQ_FP8_GROUPED_FILE"  # a tuned file to read instead of CONFIG_DIR's for this device
CONFIG_DIR = Path(__file__).parent / "moe" / "configs"


def gemm_key(n: int, k: int, gated: bool) -> str:
    return f"N={n},K={k}" + (",gated" if gated else "")


def tuned_file(experts: int, device: str) -> Path:
    """Where the tuned tilings for `device` (`moe.config.device_name`) live: what
    `benchmarks/kernels/fp8_grouped.py` writes as fp8_grouped_tuned.json, checked in."""
    return CONFIG_DIR / f"fp8_grouped,E={experts},device={device}.json"


@functools.lru_cache(maxsize=16)
def load_tuned(path: str) -> dict[str, dict[int, Tiles]]:
    """{gemm_key: {rows: Tiles}} of a tuned file; {} when there is none."""
    p = Path(path)
    if not p.is_file():
        return {}
    raw = json.loads(p.read_text())
    return {g: {int(r): Tiles(**t) for r, t in rows.items()} for g, rows in raw["gemms"].items()}


def save_tuned(path: Path, gemms: dict[str, dict[int, Tiles]], meta: dict) -> None:
    body = {
        "meta": meta,
        "gemms": {g: {str(r): asdict(t) for r, t in sorted(rows.items())} for g, rows in gemms.items()},
    }
    path.write_text(json.dumps(body, indent=1) + "\n")
