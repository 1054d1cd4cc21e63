"""Load a DiffusionGemma checkpoint once per process: the testbed, a local HF directory holding the
real model, or real-shape random weights (`random:26b-a4b`, `random:testbed`).

Every path goes through `DiffusionGemmaForBlockDiffusion`, so the committed testbed and a real
checkpoint load through the same code. The D2F LoRA adapter (`<dir>/d2f_adapter/`, peft format) is
merged into a second copy on demand: the official sampler keeps the plain weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "testbed"
ADAPTER_DIRNAME = "d2f_adapter"


def default_model_spec() -> str:
    return os.environ.get("CANVASQ_MODEL") or str(DEFAULT_MODEL_DIR)


@dataclass
class ModelBundle:
    hf_model: Any
    tokenizer: Any
    spec: str
    device: str
    _d2f: Any = field(default=None, repr=False)

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
        """Prompt ids as the model was trained to see them: the chat template when the tokenizer
        has one (real checkpoint), else the testbed layout `<bos> prompt <sep>`."""
        tok = self.tokenizer
        if tok is None:
            raise RuntimeError(f"model {self.spec!r} has no tokenizer")
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        from canvasq.testbed.prompting import encode_prompt

        return encode_prompt(tok, text)

    def decode_text(self, ids) -> str:
        out = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            if i != self.pad_id:
                out.append(i)
        return self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else ""

    def d2f_model(self):
        """The model with the D2F adapter merged (the plain model when there is no adapter)."""
        if self._d2f is None:
            self._d2f = merge_adapter(self.hf_model, self.adapter_dir) if self.adapter_dir else self.hf_model
        return self._d2f


def merge_adapter(hf_model, adapter_dir: Path):
    """A copy of `hf_model` with the peft LoRA in `adapter_dir` merged into its weights."""
    import copy

    from peft import PeftModel

    base = copy.deepcopy(hf_model)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return merged.eval()


def build_random(name: str, device: str, dtype):
    """Random weights at a named shape, built directly on `device`."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    if name == "26b-a4b":
        from canvasq.model.shapes import real_config

        config = real_config()
    elif name == "testbed":
        from canvasq.testbed.config import build_config

        config = build_config()
    else:
        raise ValueError(f"unknown random shape {name!r}; known: 26b-a4b, testbed")
    with torch.device(device):
        model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    return model.eval()


def load_bundle(spec: str | None = None, device: str = "cpu", dtype=None) -> ModelBundle:
    """Load once per process. `dtype` defaults to fp32 on CPU and bf16 on CUDA."""
    import torch

    spec = spec or default_model_spec()
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        model = build_random(name, device, dtype)
        tokenizer = None
        if name == "testbed" and (DEFAULT_MODEL_DIR / "tokenizer.json").exists():
            tokenizer = _load_tokenizer(DEFAULT_MODEL_DIR)
        return ModelBundle(model, tokenizer, spec, device)

    path = Path(spec)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {spec!r} (expected a HF directory with config.json)")
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return ModelBundle(model, _load_tokenizer(path), str(path), device)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
