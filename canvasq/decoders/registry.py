"""The explicit decoder registry: a name → its strategy class and typed config. An unknown name
fails loudly; nothing is discovered by import side effects. Classes are imported on first use so the
service can list names without importing torch."""

from __future__ import annotations

import dataclasses
import importlib

from canvasq.decoders.configs import CONFIGS, with_overrides

_CLASSES = {
    "official": "canvasq.decoders.official:OfficialDecoder",
    "hf": "canvasq.decoders.hf:HfDecoder",
    "pipe": "canvasq.decoders.pipe:PipeDecoder",
    "funnel": "canvasq.decoders.funnel:FunnelDecoder",
    "phcd": "canvasq.decoders.phcd:PhcdDecoder",
}
NAMES = tuple(_CLASSES)
# classes that serve a registered name instead of its own (`substitute`): benchmarks run a decoder's
# loop on recorded schedules this way (`benchmarks/replay.py`); empty in production
_SUBSTITUTES: dict[str, type] = {}


class UnknownDecoder(ValueError):
    pass


def decoder_class(name: str):
    if name in _SUBSTITUTES:
        return _SUBSTITUTES[name]
    try:
        target = _CLASSES[name]
    except KeyError:
        raise UnknownDecoder(f"unknown decoder {name!r}; known: {', '.join(NAMES)} (and 'auto')") from None
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def substitute(name: str, cls: type | None) -> None:
    """Serve decoder `name` with `cls` (a subclass of its own class) in this process; None restores it."""
    if name not in _CLASSES:
        raise UnknownDecoder(f"unknown decoder {name!r}; known: {', '.join(NAMES)}")
    if cls is None:
        _SUBSTITUTES.pop(name, None)
    else:
        _SUBSTITUTES[name] = cls


def make_config(name: str, overrides: dict | None = None):
    if name not in CONFIGS:
        raise UnknownDecoder(f"unknown decoder {name!r}; known: {', '.join(NAMES)} (and 'auto')")
    return with_overrides(CONFIGS[name](), overrides)


def make_decoder(
    name: str,
    bundle,
    overrides: dict | None = None,
    cuda_graphs: str | None = None,
    experts: str | None = None,
    fp8: str | None = None,
    fp8_min_rows: int | None = None,
):
    """A ready strategy instance: `.decode(batch, should_stop) -> list[DecodeResult]`.
    `cuda_graphs`, `experts`, `fp8` and `fp8_min_rows` (the service settings) apply to the decoders
    that have that option, unless `overrides` set it themselves."""
    config = make_config(name, overrides)
    service = (
        ("cuda_graphs", cuda_graphs),
        ("experts", experts),
        ("fp8", fp8),
        ("fp8_min_rows", fp8_min_rows),
    )
    for key, value in service:
        if value is not None and hasattr(config, key) and key not in (overrides or {}):
            config = dataclasses.replace(config, **{key: value})
    return decoder_class(name)(bundle, config)
