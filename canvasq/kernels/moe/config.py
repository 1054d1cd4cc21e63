"""Launch configs of the W4 MoE: the tile dataclass and the tuned JSON files in `configs/` (keyed by
shape, dtype and device; written by benchmarks/kernels/tune_moe.py and the Gluon probe)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .quant import W4Experts

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class MoeLaunchConfig:
    """Tile sizes of one MoE call. BLOCK_M is the routing block (rows of one expert per program)."""

    block_m: int = 32
    gate_up_block_n: int = 64
    gate_up_warps: int = 4
    gate_up_stages: int = 4
    down_block_n: int = 128
    down_warps: int = 4
    down_stages: int = 4
    combine_block_n: int = 1024
    # the Gluon kernels' tiles (gluon_w4.py), which run instead of the Triton ones on a tiled pack
    # (W4Experts.tiled, `launch.prefer_tiled`): a program's columns are 16 * warps * tiles (the *_block_n /
    # *_stages above are the Triton kernels')
    gluon_gate_up_warps: int = 4
    gluon_gate_up_tiles: int = 1
    gluon_down_warps: int = 4
    gluon_down_tiles: int = 2
    gluon_block_m: int | None = None  # the Gluon kernels' routing block (None: block_m)
    # 0: the next group's tiles wait in registers; >= 2: cp.async through that many shared-memory stages
    gluon_gate_up_stages: int = 0
    gluon_down_stages: int = 0
    # register cap per thread (ptxas maxnreg; None: the compiler's choice): more programs per SM for
    # these latency-bound kernels, at the price of spills
    gluon_gate_up_maxnreg: int | None = None
    gluon_down_maxnreg: int | None = None


@lru_cache(maxsize=16)
def device_name(device: torch.device) -> str:
    """The name the tuned files carry (spaces as _); "cpu" off CUDA. Cached: launchers ask per call."""
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(
    num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, device: str
) -> str:
    dt = str(dtype).replace("torch.", "")
    return f"E={num_experts},H={hidden},I={inter},K={top_k},dtype={dt},device={device}.json"


@lru_cache(maxsize=64)
def load_configs(path: str) -> dict[int, MoeLaunchConfig]:
    """{rows: config} of one tuned file; {} when it does not exist."""
    p = Path(path)
    if not p.exists():
        return {}
    raw = json.loads(p.read_text())
    return {int(t): MoeLaunchConfig(**cfg) for t, cfg in raw["configs"].items()}


def save_configs(path: Path, configs: dict[int, MoeLaunchConfig], meta: dict) -> None:
    body = {"meta": meta, "configs": {str(t): asdict(c) for t, c in sorted(configs.items())}}
    path.write_text(json.dumps(body, indent=1) + "\n")


def get_config(num_tokens: int, top_k: int, packed: W4Experts, dtype: torch.dtype) -> MoeLaunchConfig:
    """Tuned config for the nearest token count at or above `num_tokens` (else the largest); default
    when no file exists for this shape and device. Overrides: `CANVASQ_MOE_CONFIG` (one config as a
    JSON object) or `CANVASQ_MOE_CONFIG_FILE` (a tuned file written by benchmarks/kernels/tune_moe.py)."""
    override = os.environ.get("CANVASQ_MOE_CONFIG")
    if override:
        return MoeLaunchConfig(**json.loads(override))
    path = os.environ.get("CANVASQ_MOE_CONFIG_FILE") or str(
        CONFIG_DIR
        / config_file_name(
            packed.num_experts, packed.hidden, packed.inter, top_k, dtype, device_name(packed.device)
        )
    )
    table = load_configs(path)
    return nearest_at_or_above(table, num_tokens) if table else MoeLaunchConfig()


def nearest_at_or_above(table: dict, rows: int):
    """A tuned table's entry for the smallest row count at or above `rows`, else its largest."""
    above = [r for r in table if r >= rows]
    return table[min(above)] if above else table[max(table)]


def triton_constexprs(
    which: str, cfg: MoeLaunchConfig, group: int, num_groups: int, k_width: int, dtype: torch.dtype,
    compiled: bool,
) -> dict:  # fmt: skip
    """The constexprs `launch_matmul` gives kernels.py's `_w4_<which>_kernel` (also its compile spec)."""
    return {
        "GROUP": group,
        "NUM_GROUPS": num_groups,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": getattr(cfg, f"{which}_block_n"),
        "DOT_PREC": "ieee" if dtype == torch.float32 else "tf32",
        "DEQUANT": _dequant_mode(dtype, compiled),
        "EVEN_K": k_width % group == 0,
    }


def _dequant_mode(dtype: torch.dtype, compiled: bool) -> int:
    """kernels.py's DEQUANT for `dtype` operands: the magic-float OR, in inline PTX when compiled for a
    GPU (fp16/bf16; the interpreter runs no PTX)."""
    return _PTX_MODE[dtype] if compiled and dtype in _PTX_MODE else _MAGIC_MODE[dtype]


_MAGIC_MODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_PTX_MODE = {torch.float16: 4, torch.bfloat16: 5}
