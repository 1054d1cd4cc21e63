"""What validation knows of a model without importing torch: its context, canvas length and a prompt
counter that counts as the worker tokenises (`model_context`), and why it cannot load (`model_problem`:
config.json parses, every safetensors header is whole)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from canvasq.model.loading import DEFAULT_MODEL_DIR, ModelBundle  # no torch at import
from canvasq.model.shapes import REAL_26B_A4B, TESTBED  # dataclasses: no torch, no transformers


class PromptTokens:
    """How many ids the worker's `ModelBundle.encode_prompt` makes of a prompt, counted without torch.
    `count` tokenises; `at_most` bounds it from the text's length alone, so only prompts long enough to
    matter pay for a tokenizer pass."""

    def __init__(self, count: Callable[[str], int]):
        self.count = count

    @cached_property
    def _template_ids(self) -> int:
        return self.count("")

    def at_most(self, text: str) -> int:
        """A token spans at least one byte and a SentencePiece word adds at most one marker token, so
        a text makes at most twice its UTF-8 bytes in ids; plus the layout's own ids and a margin."""
        return 2 * len(text.encode("utf-8", "surrogatepass")) + self._template_ids + 16


@dataclass(frozen=True)
class ModelContext:
    """What validation knows of a model's context, read without torch."""

    positions: int | None  # prompt + answer (max_position_embeddings); None: unknown
    canvas_length: int = 1  # 1: unknown (max_tokens then counts as it is: still a necessary condition)
    prompt_tokens: PromptTokens | None = None  # None: no tokenizer here; the worker's check is the judge


# the shapes `build_random` builds (one source of truth: 26B-A4B is 262,144, not the 131,072 once here)
_RANDOM_SHAPES = {"random:26b-a4b": REAL_26B_A4B, "random:testbed": TESTBED}


def model_context(spec: str) -> ModelContext:
    """The context, canvas length and prompt counter of a model spec, without importing torch.

    Prompts are counted as `ModelBundle.encode_prompt` tokenises them: the chat template through the
    transformers tokenizer when the directory has one (a real checkpoint; loaded at the first prompt
    that needs counting), else the block layout `<bos> prompt <sep>` over `tokenizer.json` through
    `tokenizers` (a light Rust library). `random:` models read the testbed's tokenizer, as
    `load_bundle` gives them.
    """
    if spec in _RANDOM_SHAPES:
        shape = _RANDOM_SHAPES[spec]
        return ModelContext(
            shape.max_position_embeddings, shape.canvas_length, _block_layout(DEFAULT_MODEL_DIR)
        )
    d = Path(spec)
    ctx: int | None = None
    canvas = 1
    try:
        cfg = json.loads((d / "config.json").read_text())
        text_cfg = cfg.get("text_config", cfg)  # the config file's own layout, not our settings
        canvas = int(cfg.get("canvas_length") or text_cfg.get("canvas_length") or 1)
        ctx = int(text_cfg["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ctx = None
    if ctx is None:  # no config.json yet: the tokenizer's declared limit
        try:
            ctx = int(json.loads((d / "tokenizer_config.json").read_text())["model_max_length"])
        except (OSError, ValueError, KeyError, TypeError):
            ctx = None
    counter = _chat_template(d) if _has_chat_template(d) else _block_layout(d)
    return ModelContext(ctx, canvas, counter)


def _has_chat_template(d: Path) -> bool:
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _block_layout(d: Path) -> PromptTokens | None:
    """`<bos> prompt <sep>`: `ModelBundle.encode_prompt` without a chat template (the testbed)."""
    tok_file = d / "tokenizer.json"
    if not tok_file.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
    except Exception:  # noqa: BLE001 - a tokenizer file we cannot read: leave the check to the worker
        return None
    return PromptTokens(lambda text: len(tok.encode(text, add_special_tokens=False).ids) + 2)


def _chat_template(d: Path) -> PromptTokens:
    """The worker's own `ModelBundle.encode_prompt` over the transformers tokenizer (no model)."""
    bundle: list[ModelBundle] = []

    def count(text: str) -> int:
        if not bundle:
            from transformers import AutoTokenizer

            bundle.append(ModelBundle(None, AutoTokenizer.from_pretrained(str(d)), str(d), "cpu"))
        return len(bundle[0].encode_prompt(text))

    return PromptTokens(count)


def model_problem(spec: str) -> str | None:
    """Why the model `spec` cannot load, found without torch (config.json parses, every safetensors
    header is readable and its tensors fit in the file), or None. Run before a run is created, so a
    broken model leaves no orphan run behind."""
    if spec in _RANDOM_SHAPES:
        return None
    if spec.startswith("random:"):
        return f"unknown random model {spec!r}; known: {', '.join(_RANDOM_SHAPES)}"
    d = Path(spec)
    if not d.is_dir():
        return (
            f"model directory {spec} does not exist" if not d.exists() else f"model {spec} is not a directory"
        )
    try:
        cfg = json.loads((d / "config.json").read_text())
    except OSError as exc:
        return f"model {spec}: cannot read config.json ({exc.strerror or exc})"
    except ValueError as exc:
        return f"model {spec}: config.json is not valid JSON ({exc})"
    if not isinstance(cfg, dict):
        return f"model {spec}: config.json is not valid JSON (not an object)"
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return f"model {spec}: no *.safetensors weights"
    for f in files:
        problem = _safetensors_problem(f)
        if problem:
            return f"model {spec}: {f.name} {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """The file's header: 8-byte little-endian length, that many bytes of JSON, tensor data after it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, 100 << 20):
                return "is not a safetensors file (bad header length)"
            header = json.loads(fh.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except (ValueError, KeyError, TypeError, IndexError):
        return "has a corrupt header"
    if ends and max(ends) > size - 8 - n:
        return f"is truncated ({size} bytes; its header needs {8 + n + max(ends)})"
    return None
