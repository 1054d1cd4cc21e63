"""Grouped W4A16 MoE: packing (`quant`), Triton kernels on K-contiguous packs (`kernels`), Gluon kernels
on tiled packs, the CUDA default (`gluon_w4`; the tiled order `gluon_pack`, the tiles' register layouts
`gluon_layouts`), launchers + `w4_moe` (`launch`), torch twins (`reference`),
safetensors cache and HF model patching (`store`), launch configs and the tuned files (`config`,
`configs/`)."""

from .config import MoeLaunchConfig, get_config
from .launch import (
    ExpertRows,
    RoutingMeta,
    align_routing,
    align_routing_reference,
    w4_moe,
    w4_moe_launch,
)
from .quant import W4Config, W4Experts, pack_w4, packed_bytes, unpack_w4
from .reference import moe_reference, w4_moe_reference
from .store import load_packed, pack_model_experts, save_packed

__all__ = [
    "ExpertRows",
    "MoeLaunchConfig",
    "RoutingMeta",
    "W4Config",
    "W4Experts",
    "align_routing",
    "align_routing_reference",
    "get_config",
    "load_packed",
    "moe_reference",
    "pack_model_experts",
    "pack_w4",
    "packed_bytes",
    "save_packed",
    "unpack_w4",
    "w4_moe",
    "w4_moe_launch",
    "w4_moe_reference",
]
