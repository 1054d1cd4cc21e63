"""Packed experts on disk (safetensors) and in a loaded HF model.

`pack_model_experts(hf_model)` finds every experts module (anything with 3-D `gate_up_proj [E, 2I, H]`
and `down_proj [E, H, I]` parameters), packs each distinct weight once (DiffusionGemma's encoder and
decoder share their expert tensors, so both modules get the same `W4Experts`), drops the BF16
parameters and swaps the module's forward for `w4_moe`. With `cache=path` it loads a previous packing
instead of repacking, or writes one.

File layout: one tensor per field, key `"{group}.{field}"` (group = the first module name that owns the
weights), and metadata `canvasq_w4` = JSON {group: {hidden, inter, group_gate_up, group_down,
modules: [names], layout}}. `layout` is `quant.PACK_LAYOUT`; a file without it or with another one
(an older canvasq's packing) does not load (`StalePackError`), and `pack_model_experts` repacks over it. Files hold the K-contiguous order; on CUDA the installed packs
are tiled for the Gluon kernels (`launch.prefer_tiled`).
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from .launch import prefer_tiled
from .quant import PACK_LAYOUT, W4Config, W4Experts, pack_w4

log = logging.getLogger(__name__)
_META_KEY = "canvasq_w4"


class StalePackError(ValueError):
    """A packed-experts file written for another nibble layout than this canvasq's."""


def save_packed(
    path: str | Path, packs: dict[str, W4Experts], modules: dict[str, list[str]] | None = None
) -> None:
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, p in packs.items():
        gq, dq = p.kcontig_q()  # files always hold the K-contiguous order (and no packed words)
        fields = {k: v for k, v in p.tensors().items() if not k.endswith("_sz")}
        for field, t in dict(fields, gate_up_q=gq, down_q=dq).items():
            tensors[f"{name}.{field}"] = t.detach().contiguous().cpu()
        meta[name] = {
            "hidden": p.hidden,
            "inter": p.inter,
            "group_gate_up": p.config.group_gate_up,
            "group_down": p.config.group_down,
            "modules": (modules or {}).get(name, [name]),
            "layout": PACK_LAYOUT,
        }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta)})


def load_packed(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, W4Experts], dict[str, list[str]]]:
    """-> ({group: W4Experts}, {group: module names sharing it})."""
    from safetensors import safe_open

    packs, modules = {}, {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = json.loads(f.metadata()[_META_KEY])
        for name, m in meta.items():
            if m.get("layout") != PACK_LAYOUT:
                raise StalePackError(
                    f"{path}: packed for layout {m.get('layout', 'q[E,Kp/2,N], unlabelled')!r}, "
                    f"this canvasq reads {PACK_LAYOUT!r}; delete the file to repack"
                )
            fields = {
                k: f.get_tensor(f"{name}.{k}")
                for k in ("gate_up_q", "gate_up_scale", "gate_up_zero", "down_q", "down_scale", "down_zero")
            }
            cfg = W4Config(group_gate_up=m["group_gate_up"], group_down=m["group_down"])
            packs[name] = W4Experts(**fields, hidden=m["hidden"], inter=m["inter"], config=cfg)
            packs[name].validate()
            modules[name] = m["modules"]
    return packs, modules


def _expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found = []
    for name, mod in model.named_modules():
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3:
            found.append((name, mod))
    return found


def _w4_forward(self, hidden_states, top_k_index, top_k_weights):
    from .launch import w4_moe

    return w4_moe(hidden_states, top_k_index, top_k_weights, self.w4_experts)


def _install(mod: torch.nn.Module, packed: W4Experts) -> None:
    for pname in ("gate_up_proj", "down_proj"):
        if pname in mod._parameters:
            del mod._parameters[pname]
        elif hasattr(mod, pname):
            delattr(mod, pname)
    mod.w4_experts = packed  # type: ignore[assignment]  # nn.Module types its attributes Tensor | Module
    mod.forward = types.MethodType(_w4_forward, mod)


def pack_model_experts(
    model: torch.nn.Module,
    config: W4Config | None = None,
    cache: str | Path | None = None,
    device: str | torch.device | None = None,
    materialize: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
) -> dict[str, W4Experts]:
    """Pack every experts module of `model` in place (see module docstring); returns {group: W4Experts}.

    Packing runs on `device` (default: the weights' device; GPU: seconds per layer; the BF16 copy of a
    layer is freed as soon as it is packed). A model still on the CPU with `device="cuda"` has one
    layer's BF16 experts on the GPU at a time, and the packs end there. With `cache` pointing to an
    existing file, nothing is quantised. Experts on the meta device (a random build that never holds
    every layer's BF16 experts at once) get their values from `materialize(meta, device)`, a layer at
    a time.
    """
    mods = _expert_modules(model)
    if not mods:
        return {}
    # nn.Module types its attributes Tensor | Module: _expert_modules found Tensors
    dev = torch.device(device) if device is not None else cast(torch.Tensor, mods[0][1].gate_up_proj).device
    loaded = None
    if cache is not None and Path(cache).exists():
        try:
            loaded = load_packed(cache, dev)
        except StalePackError as ex:
            log.warning("%s: repacking", ex)
    if loaded is not None:
        return _install_all(mods, *loaded, source=cache)

    groups: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, mod in mods:  # tied encoder/decoder experts share the Parameter object
        groups.setdefault(id(mod.gate_up_proj), []).append((name, mod))
    packs, owners = {}, {}
    for members in groups.values():
        first_name, first = members[0]
        gate_up, down = (
            _values(cast(torch.Tensor, t), dev, materialize) for t in (first.gate_up_proj, first.down_proj)
        )
        packs[first_name] = pack_w4(gate_up, down, config)
        del gate_up, down
        owners[first_name] = [n for n, _ in members]
        for _, mod in members:  # drops the BF16 parameters now (frees the layer on a GPU)
            _install(mod, packs[first_name])
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if cache is not None:
        save_packed(cache, packs, owners)
    return _install_all(mods, packs, owners, source="packing")


def _values(t: torch.Tensor, dev: torch.device, materialize) -> torch.Tensor:
    if not t.is_meta:
        return t.data.to(dev)
    if materialize is None or dev.type == "meta":
        raise ValueError(
            "experts on the meta device need `materialize` and a `device` (only a random build has no values)"
        )
    return materialize(t, dev)


def _install_all(
    mods, packs: dict[str, W4Experts], owners: dict[str, list[str]], source
) -> dict[str, W4Experts]:
    """Install each group's pack (tiled where `prefer_tiled`) on every module that shares it."""
    by_name = dict(mods)
    out = {}
    for group, names in owners.items():
        out[group] = prefer_tiled(packs.pop(group))  # pop: a tiled copy replaces the K-contiguous one
        for n in names:
            assert n in by_name, f"{source}: module {n} not in the model"
            _install(by_name[n], out[group])
    return out
