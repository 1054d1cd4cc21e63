"""A D2F adapter chosen by path (pipe's and Funnel's `adapter_path`): the model with a peft LoRA
merged that is not the checkpoint's own `<dir>/d2f_adapter/`, e.g. one `canvasq adapt` trained.

The merged copy is cached on the bundle per resolved directory, as `bundle.d2f_model()` caches the
default one, so every decoder of a process that names the same directory shares one copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CACHE_ATTR = "_canvasq_path_adapters"  # {resolved dir: merged model}, set on the bundle instance


def resolve(bundle, path: str) -> Path:
    """`path` as given (absolute, or relative to the working directory), else relative to the model
    directory; a directory without `adapter_config.json` raises `FileNotFoundError`."""
    for cand in (Path(path), Path(bundle.spec) / path):
        if (cand / "adapter_config.json").is_file():
            return cand.resolve()
    raise FileNotFoundError(f"adapter_path={path!r}: no peft adapter (adapter_config.json) there")


def merged_model(bundle, path: str) -> Any:
    """The bundle's base model with the LoRA at `path` merged (cached per directory)."""
    from canvasq.model.loading import merge_adapter

    where = resolve(bundle, path)
    cache: dict[Path, Any] = bundle.__dict__.setdefault(_CACHE_ATTR, {})
    if where not in cache:
        cache[where] = merge_adapter(bundle.hf_model, where)
    return cache[where]
