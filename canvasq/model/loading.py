"""Load a DiffusionGemma checkpoint once per process: the testbed, a local HF directory holding the
real model, or real-shape random weights (`random:26b-a4b`, `random:testbed`).

Every path goes through `DiffusionGemmaForBlockDiffusion`, so the committed testbed and a real
checkpoint load through the same code. The D2F LoRA adapter (`<dir>/d2f_adapter/`, peft format) is
merged into a second copy on demand: the official sampler keeps the plain weights.

With `experts="w4"` the experts are packed in place as the model loads (`pack_model_experts`): the
checkpoint is read on the CPU, each layer's BF16 experts go to the device one at a time, are packed
and freed, then the rest of the model follows. The packs are cached (`w4_cache_path`) so the next
start reads them instead of packing; the GPU never holds the BF16 experts.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "testbed"
ADAPTER_DIRNAME = "d2f_adapter"
PHCD_ADAPTER_DIRNAME = "phcd_adapter"  # phcd's repair LoRA, trained over the D2F-merged model
W4_DIRNAME = "canvasq_w4"
EXPERTS = ("bf16", "w4")

log = logging.getLogger(__name__)


def default_model_spec() -> str:
    return os.environ.get("CANVASQ_MODEL") or str(DEFAULT_MODEL_DIR)


@dataclass
class ModelBundle:
    hf_model: Any
    tokenizer: Any
    spec: str
    device: str
    experts: str = "bf16"  # "w4": the experts modules hold packs (their BF16 weights are gone)
    _d2f: Any = field(default=None, repr=False)
    _phcd_repair: Any = field(default=None, repr=False)

    @property
    def config(self):
        return self.hf_model.config

    @property
    def canvas_length(self) -> int:
        return int(self.hf_model.config.canvas_length)

    @property
    def eos_id(self) -> int:
        eos = self.hf_model.generation_config.eos_token_id
        if eos is None:
            eos = self.hf_model.config.text_config.eos_token_id
        return int(eos[0] if isinstance(eos, (list, tuple)) else eos)

    @property
    def pad_id(self) -> int:
        pad = self.hf_model.config.text_config.pad_token_id
        return int(pad if pad is not None else 0)

    @property
    def adapter_dir(self) -> Path | None:
        path = Path(self.spec) / ADAPTER_DIRNAME
        return path if path.is_dir() else None

    def encode_prompt(self, text: str, task: str | None = None) -> list[int]:
        """Prompt ids as the model was trained to see them: the chat template when the tokenizer has
        one (real checkpoint), else the plain block layout `<bos> prompt <sep>` with the tokenizer's
        own ids (the testbed: the answer follows in canvases and ends with `<eos>`)."""
        tok = self.tokenizer
        if tok is None:
            raise RuntimeError(f"model {self.spec!r} has no tokenizer")
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        sep = tok.convert_tokens_to_ids("<sep>")
        if tok.bos_token_id is None or sep is None or sep == tok.unk_token_id:
            raise RuntimeError(
                f"model {self.spec!r}: its tokenizer has neither a chat template nor <bos>/<sep>"
            )
        return [tok.bos_token_id, *tok.encode(text, add_special_tokens=False), sep]

    def decode_text(self, ids) -> str:
        """The answer's text: ids up to the first EOS, PAD dropped. (eos_id and pad_id are read once:
        each read goes through the HF config's attribute hooks, ~3 µs, which per token cost ~4 ms a
        550-token row on the worker's critical path.)"""
        eos, pad = self.eos_id, self.pad_id
        ids = [int(x) for x in ids]
        if eos in ids:
            ids = ids[: ids.index(eos)]
        out = [i for i in ids if i != pad]
        return self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else ""

    def d2f_model(self):
        """The model with the D2F adapter merged (the plain model when there is no adapter). With W4
        experts the copy shares the packs (the adapter does not touch the experts)."""
        if self._d2f is None and self.adapter_dir:
            try:
                self._d2f = merge_adapter(self.hf_model, self.adapter_dir)
            except Exception as exc:
                if self.experts != "w4":
                    raise
                raise RuntimeError(
                    f"merging the D2F adapter {self.adapter_dir} into a model with W4 experts "
                    f"failed ({type(exc).__name__}: {exc}); run with CANVASQ_EXPERTS=bf16"
                ) from exc
        return self._d2f if self._d2f is not None else self.hf_model

    @property
    def phcd_adapter_dir(self) -> Path | None:
        path = Path(self.spec) / PHCD_ADAPTER_DIRNAME
        return path if path.is_dir() else None

    def phcd_repair_model(self):
        """The D2F model with phcd's repair LoRA (`<dir>/phcd_adapter/`) merged on top (cached)."""
        if self._phcd_repair is None:
            if self.phcd_adapter_dir is None:
                raise FileNotFoundError(
                    f"model {self.spec!r} has no {PHCD_ADAPTER_DIRNAME}/ "
                    "(python -m canvasq.testbed.repair trains it)"
                )
            self._phcd_repair = merge_adapter(self.d2f_model(), self.phcd_adapter_dir)
        return self._phcd_repair

    def engine(self) -> dict[str, Any]:
        """What this process runs on: device, experts and the CUDA graph counters of its decode loops."""
        from canvasq.model.graph import graph_totals

        packed = sum(1 for m in self.hf_model.modules() if getattr(m, "w4_experts", None) is not None)
        return {
            "device": str(self.device),
            "experts": self.experts,
            "w4_modules": packed,
            "graphs": graph_totals(),
        }


def merge_adapter(hf_model, adapter_dir: Path):
    """A copy of `hf_model` with the peft LoRA in `adapter_dir` merged into its weights."""
    import copy
    import warnings

    from peft import PeftModel

    base = copy.deepcopy(hf_model)
    with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return merged.eval()


def build_random(name: str, device: str, dtype, experts_on_meta: bool = False):
    """Random weights at a named shape, built directly on `device`. With `experts_on_meta` the routed
    experts are left on the meta device (no values, no memory) for `_pack` to make a layer at a time:
    HF builds the encoder's and the decoder's experts before it ties them, 2 x 45 GiB in BF16 at the
    real shape, which no 80 GiB GPU holds."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvasq.model.shapes import SHAPES, build_config

    if name not in SHAPES:
        raise ValueError(f"unknown random shape {name!r}; known: {', '.join(SHAPES)}")
    config = build_config(SHAPES[name])
    with torch.device(device), _experts_on_meta(experts_on_meta):
        model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    return model.eval()


@contextlib.contextmanager
def _experts_on_meta(on: bool):
    """While on: HF's experts modules build their parameters on the meta device."""
    if not on:
        yield
        return
    import torch
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf

    cls = hf.DiffusionGemmaTextExperts
    init = cls.__init__

    def meta_init(self, *args, **kwargs):
        with torch.device("meta"):
            init(self, *args, **kwargs)

    setattr(cls, "__init__", meta_init)  # noqa: B010 -- a method replaced for the build (mypy: method-assign)
    try:
        yield
    finally:
        setattr(cls, "__init__", init)  # noqa: B010


def _random_experts(meta, device):
    """Values for a random build's meta experts (`build_random`): HF's initializer scale."""
    import torch

    return torch.randn(meta.shape, dtype=meta.dtype, device=device) * 0.02


def freeze_heap() -> None:
    """Keep the objects alive now out of Python's cyclic garbage collector: call it once a process's
    long-lived state (a loaded model) is built. A full collection walks every tracked object. After a
    testbed load that is ~440k of them, 240 ms a pass on 2 CPU cores, and on an H100 host a 600-row
    stream paid 0.6-0.7 s for each full collection that fell mid-decode (a third of its arms)."""
    gc.collect()
    gc.freeze()


def load_bundle(
    spec: str | None = None,
    device: str = "cpu",
    dtype=None,
    experts: str = "bf16",
    cache_dir: str | None = None,
) -> ModelBundle:
    """Load once per process. `dtype` defaults to fp32 on CPU and bf16 on CUDA. `experts="w4"` packs the
    experts at load (module docstring), caching the packs at `w4_cache_path(spec, cache_dir)`."""
    import torch

    if experts not in EXPERTS:
        raise ValueError(f"CANVASQ_EXPERTS={experts!r}: expected auto, w4 or bf16")
    spec = spec or default_model_spec()
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        w4_on_gpu = experts == "w4" and device != "cpu"
        model = build_random(name, device, dtype, experts_on_meta=w4_on_gpu)
        if experts == "w4":  # built on the device: packed layer by layer, each BF16 layer freed as it goes
            _pack(model, device, cache=None, materialize=_random_experts if w4_on_gpu else None)
        tokenizer = None  # random weights read the testbed's ids (all below any shape's vocabulary)
        if (DEFAULT_MODEL_DIR / "tokenizer.json").exists():
            tokenizer = _load_tokenizer(DEFAULT_MODEL_DIR)
        return ModelBundle(model, tokenizer, spec, device, experts)

    path = Path(spec)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {spec!r} (expected a HF directory with config.json)")
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=dtype).eval()  # on the CPU
    if experts == "w4":
        _pack(model, device, cache=w4_cache_path(path, dtype, cache_dir))
    return ModelBundle(model.to(device), _load_tokenizer(path), str(path), device, experts)


def _pack(model, device: str, cache: Path | None, materialize=None) -> dict:
    import time

    from canvasq.kernels.moe.store import pack_model_experts

    hit = cache is not None and cache.exists()
    t0 = time.perf_counter()
    packs = pack_model_experts(model, cache=cache, device=device, materialize=materialize)
    gib = sum(p.nbytes() for p in packs.values()) / 2**30
    how = f"read from {cache}" if hit else "packed" + (f", cached at {cache}" if cache else "")
    log.info("W4 experts: %d layers, %.2f GiB, %s in %.1fs", len(packs), gib, how, time.perf_counter() - t0)
    return packs


def pack_checkpoint(spec: str, device: str = "cpu", dtype=None, cache_dir: str | None = None) -> Path:
    """Pack a local checkpoint's experts into its cache ahead of time (`canvasq pack`); returns the file.
    `dtype` (default bf16, what a GPU worker loads) is part of the cache's name."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    path = Path(spec)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {spec!r} (expected a HF directory with config.json)")
    dtype = dtype or torch.bfloat16
    cache = w4_cache_path(path, dtype, cache_dir)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=dtype).eval()
    if not _pack(model, device, cache):
        raise ValueError(f"{spec}: no experts modules to pack")
    return cache


def w4_cache_path(model_dir: str | Path, dtype, cache_dir: str | Path | None = None) -> Path:
    """Where a checkpoint's packed experts are cached: `cache_dir` (CANVASQ_W4_CACHE_DIR) when set,
    else `<model_dir>/canvasq_w4/` when that is writable, else `~/.cache/canvasq/w4/`. The file name
    carries a fingerprint of the weight files (names, sizes, mtimes), so a changed checkpoint repacks,
    and the dtype the packs were made in (their scales')."""
    model_dir = Path(model_dir).resolve()
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    h = hashlib.sha256()
    for p in weights:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    name = f"experts-{h.hexdigest()[:12]}-{str(dtype).removeprefix('torch.')}.safetensors"
    if cache_dir is None:
        beside = model_dir / W4_DIRNAME
        if os.access(beside if beside.is_dir() else model_dir, os.W_OK):
            return beside / name
        cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "canvasq" / "w4"
    where = hashlib.sha256(str(model_dir).encode()).hexdigest()[:8]
    return Path(cache_dir) / f"{model_dir.name}-{where}" / name


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@functools.cache
def _cache_arg(forward: Callable) -> str:
    """The name a DiffusionGemma module's forward takes its KV cache by: transformers renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); 5.17 knows only the old one."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """`{name: cache}` under the name `module`'s forward takes (`_cache_arg`)."""
    return {_cache_arg(type(module).forward): cache}
