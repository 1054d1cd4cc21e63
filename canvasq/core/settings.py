"""One typed settings object for the whole service, fed from `CANVASQ_*` environment variables.

    CANVASQ_DATABASE_URL   SQLAlchemy URL (default: SQLite file ./canvasq.sqlite)
    CANVASQ_BROKER_URL     Celery broker (default redis://localhost:6379/0)
    CANVASQ_MODEL          model spec: HF directory or random:26b-a4b (default: the repo's models/testbed)
    CANVASQ_ROUTING        JSON object task -> decoder, overrides `--decoder auto` routing
    CANVASQ_ROUTING_BUDGET accuracy points `--decoder auto` may give up against the official sampler
                           when it routes from a calibration (default 2.0)
    CANVASQ_CUDA_GRAPHS    auto (pipe / funnel replay CUDA graphs on a GPU) | off (eager forwards)
    CANVASQ_DEVICE         auto (the current CUDA device when one is visible, else cpu) | cpu | cuda | cuda:N
    CANVASQ_EXPERTS        auto (W4A16 experts on CUDA, BF16 on CPU) | w4 | bf16
    CANVASQ_W4_CACHE_DIR   where packed W4 experts are cached when the model directory is not writable
    CANVASQ_FP8            auto (FP8 GEMMs for large forwards on Hopper, off elsewhere) | off |
                           a list of experts, dense, head
    CANVASQ_FP8_MIN_ROWS   rows from which a forward takes the FP8 path (smaller ones are bandwidth-bound)
    CANVASQ_LEASE_S        a claimed chunk's lease, renewed by the worker's heartbeat (default 60)
    CANVASQ_HEARTBEAT_S    worker heartbeat; offline after 3 missed beats + 10 s (default 15)
    CANVASQ_RECONCILE_S    every worker's periodic reconcile pass, one per interval fleet-wide (default 15; 0 off)
    CANVASQ_CHUNK_SIZE, CANVASQ_SOFT_TIME_LIMIT, CANVASQ_HARD_TIME_LIMIT,
    CANVASQ_VISIBILITY_TIMEOUT, CANVASQ_MAX_ATTEMPTS, ...  (see the fields below)

Import cost: pydantic only. Nothing here touches torch, Celery or SQLAlchemy engines.
"""

from __future__ import annotations

import enum
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from canvasq.decoders.configs import FP8_MIN_ROWS, FP8_PARTS
from canvasq.model.loading import DEFAULT_MODEL_DIR, REPO_ROOT  # noqa: F401 (re-exported; no torch import)

DECODERS = ("auto", "official", "hf", "pipe", "funnel", "phcd")
TASKS = ("math", "code")
RANDOM_MODELS = ("random:26b-a4b", "random:testbed")
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


class Identity(enum.Enum):
    """Whether a setting is part of an embedded run's identity (`run_identity`); every field of
    `Settings` declares one as `Annotated[type, Identity.YES]`. When unsure, YES: a rerun with another
    value then starts a new run instead of mixing rows generated two ways."""

    YES = True  # can change the tokens generated (model, precision, forward path, decoder, seed)
    NO = False  # where, when, how often or how fast the same work runs; limits that only refuse a line


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CANVASQ_", extra="ignore")

    database_url: Annotated[str, Identity.NO] = "sqlite:///canvasq.sqlite"
    broker_url: Annotated[str, Identity.NO] = "redis://localhost:6379/0"
    model: Annotated[str, Identity.YES] = str(DEFAULT_MODEL_DIR)
    # task -> decoder; replaces the built-in routing of `--decoder auto` for the listed tasks.
    routing: Annotated[dict[str, str], Identity.YES] = Field(default_factory=dict)
    # accuracy points auto may give up against official's calibrated accuracy (`canvasq calibrate`)
    routing_budget: Annotated[float, Identity.YES] = Field(2.0, ge=0, le=100)

    # Requests per chunk of a submitted run (an embedded run's key holds the chunk size it ran with).
    # A worker decodes one chunk at a time, so a chunk must hold several times a GPU worker's 32 decode
    # slots: with the testbed's forward counts per row (a long tail: mean 9.8, max 97) 32 slots stay
    # 16 % full on average at chunk 16, 43 % at 128 and 95 % with the whole run in one stream
    # (simulated; BENCHMARKS "Decode slots per chunk size").
    chunk_size: Annotated[int, Identity.NO] = Field(128, ge=1, le=10_000)
    # Ordering enforced at worker start: visibility_timeout > hard_time_limit > soft_time_limit
    # (celery#5935: a shorter visibility timeout makes Redis redeliver a still-running chunk).
    soft_time_limit: Annotated[int, Identity.NO] = Field(1800, ge=1)
    hard_time_limit: Annotated[int, Identity.NO] = Field(2100, ge=1)
    visibility_timeout: Annotated[int, Identity.NO] = Field(3600, ge=1)
    # past this many deliveries a chunk's unfinished rows are worker_lost
    max_attempts: Annotated[int, Identity.NO] = Field(3, ge=1)
    heartbeat_s: Annotated[float, Identity.NO] = Field(15.0, gt=0)
    # A claimed chunk's lease in SQL, renewed by the worker's heartbeat while it works on the chunk:
    # a dead worker's chunk is re-published by reconcile once its lease lapses (the visibility
    # timeout stays the broker's own, slower, backstop). Must cover at least two missed beats.
    lease_s: Annotated[int, Identity.NO] = Field(60, ge=1)
    # Every worker runs a reconcile pass this often (one worker per interval across the fleet, by a
    # lock in Redis); 0 turns it off (then run `canvasq reconcile --loop 15` somewhere).
    reconcile_s: Annotated[float, Identity.NO] = Field(15.0, ge=0)
    run_deadline_s: Annotated[int | None, Identity.NO] = Field(None, ge=1)  # submitted runs' default
    sqlite_busy_timeout_ms: Annotated[int, Identity.NO] = Field(30_000, ge=0)

    # input validation limits: they refuse lines and change nothing a valid line generates
    max_tokens_limit: Annotated[int, Identity.NO] = Field(4096, ge=1)
    default_max_tokens: Annotated[int, Identity.YES] = Field(256, ge=1)  # for a line that gives none
    max_custom_id_len: Annotated[int, Identity.NO] = Field(64, ge=1, le=200)  # the store's column holds 200
    max_line_bytes: Annotated[int, Identity.NO] = Field(1 << 20, ge=1024)
    max_errors: Annotated[int, Identity.NO] = Field(200, ge=1)  # errors kept for the report; the rest counted
    # a response_format line's schema shown to the model: a short rendering of it on its own line before
    # the prompt (`decoders.schema_text.shown_prompt`), counted in its prompt tokens, as hosted APIs do.
    # Applied at validation (the stored prompt carries it). Off: the prompt as written; the canvas
    # constraint alone then decides the form (the testbed's JSON adapter was trained with it on)
    schema_in_prompt: Annotated[bool, Identity.YES] = True

    queue_prefix: Annotated[str, Identity.NO] = "canvasq"
    # worker device: auto (cuda when visible, else cpu) | cpu | cuda | cuda:N
    device: Annotated[str, Identity.YES] = "auto"
    # prompts decoded together; results persisted per batch. This and the two below shape the rows
    # of each forward (padding, batched GEMMs), which can move logits by rounding: identity
    decode_batch_size: Annotated[int, Identity.YES] = Field(8, ge=1)
    # requests in flight per decode stream (continuous batching; None: 64 on a GPU of >= 120 GiB, 32 on a
    # smaller one, decode_batch_size on CPU)
    decode_slots: Annotated[int | None, Identity.YES] = Field(None, ge=1)
    # When a chunk's last rows are in flight and slots free up, claim the run's next chunk from SQL and
    # feed its rows into the same stream (auto: on a GPU worker; its message is then dropped uncounted)
    claim_ahead: Annotated[Literal["auto", "on", "off"], Identity.YES] = "auto"
    seed: Annotated[int, Identity.YES] = 0
    gpu_slots: Annotated[int | None, Identity.NO] = Field(None, ge=1)  # `worker --gpu auto`: GPUs to share
    # the physical host's name for slot keys (containers differ in hostname)
    gpu_host: Annotated[str | None, Identity.NO] = None
    # CPU workers: threads per process (None: torch's default); the same operations, spread over threads
    torch_threads: Annotated[int | None, Identity.NO] = Field(None, ge=1)
    # pipe / funnel forwards replayed as CUDA graphs on a CUDA device ("auto"), or always eager ("off").
    # Identity: a graph pads rows and keeps masks on, so its logits equal eager ones only to rounding
    cuda_graphs: Annotated[Literal["auto", "off"], Identity.YES] = "auto"
    # MoE experts: W4A16 packs (packed once, cached on disk, BF16 experts freed) or the BF16 weights
    experts: Annotated[Literal["auto", "w4", "bf16"], Identity.YES] = "auto"
    # packed-experts cache for model directories that are not writable (default: ~/.cache/canvasq/w4);
    # where the same packs are kept
    w4_cache_dir: Annotated[str | None, Identity.NO] = None
    # FP8 tensor-core GEMMs for forwards of >= fp8_min_rows rows, where the forward is compute-bound
    fp8: Annotated[str, Identity.YES] = "auto"
    fp8_min_rows: Annotated[int, Identity.YES] = Field(FP8_MIN_ROWS, ge=0)

    @field_validator("fp8")
    @classmethod
    def _known_fp8(cls, v: str) -> str:
        parts = [p.strip() for p in v.lower().split(",") if p.strip()]
        if v.strip().lower() in ("auto", "off") or (parts and all(p in FP8_PARTS for p in parts)):
            return v.strip().lower()
        raise ValueError(f"expected auto, off or a comma list of {', '.join(FP8_PARTS)}")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not DEVICE_RE.fullmatch(v):
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return v

    @field_validator("routing")
    @classmethod
    def _known_decoders(cls, v: dict[str, str]) -> dict[str, str]:
        for task, dec in v.items():
            if dec not in DECODERS[1:]:
                raise ValueError(f"routing[{task!r}] = {dec!r}: decoder must be one of {DECODERS[1:]}")
        return v

    def check_time_limits(self) -> None:
        """Raise ValueError unless visibility_timeout > hard_time_limit > soft_time_limit and the chunk
        lease outlives a missed heartbeat."""
        if not (self.visibility_timeout > self.hard_time_limit > self.soft_time_limit):
            raise ValueError(
                "time limits out of order: need visibility_timeout > hard_time_limit > soft_time_limit, got "
                f"visibility_timeout={self.visibility_timeout}, hard_time_limit={self.hard_time_limit}, "
                f"soft_time_limit={self.soft_time_limit} (a shorter visibility timeout makes Redis "
                "deliver a running chunk twice, celery#5935)"
            )
        if self.lease_s < 2 * self.heartbeat_s + 5:
            raise ValueError(
                f"lease_s={self.lease_s} is too short for heartbeat_s={self.heartbeat_s}: need lease_s >= "
                "2 × heartbeat_s + 5 (a lease must outlive a missed heartbeat, or live chunks are re-published)"
            )

    @property
    def offline_after_s(self) -> float:
        """A worker whose last heartbeat is older than this is offline (three missed beats)."""
        return 3 * self.heartbeat_s + 10

    def queue_for(self, model: str | None = None) -> str:
        return queue_name(model or self.model, self.queue_prefix)

    def describe(self) -> dict[str, str]:
        """Printable view, passwords masked."""
        return {
            "database_url": mask_url(self.database_url),
            "broker_url": mask_url(self.broker_url),
            "model": self.model,
            "queue": self.queue_for(),
        }


def identity_of(name: str) -> Identity:
    """The identity flag field `name` of `Settings` declares; a field without one is a TypeError."""
    flags = [m for m in Settings.model_fields[name].metadata if isinstance(m, Identity)]
    if len(flags) != 1:
        raise TypeError(f"Settings.{name} must declare Identity.YES or Identity.NO once; it has {len(flags)}")
    return flags[0]


def run_identity(settings: Settings) -> dict[str, Any]:
    """The settings that make an embedded run what it is (JSON values): every field declared
    `Identity.YES`. A model directory counts by its resolved path (models/testbed and
    /abs/.../models/testbed are one model)."""
    values = settings.model_dump(mode="json")
    ident = {name: values[name] for name in Settings.model_fields if identity_of(name) is Identity.YES}
    if Path(settings.model).is_dir():
        ident["model"] = str(Path(settings.model).resolve())
    return ident


def resolve_experts(setting: str, device: str) -> str:
    """CANVASQ_EXPERTS for a resolved device: auto is W4 on CUDA (the Triton/Gluon kernels) and BF16
    on CPU (the interpreter has no fast W4 path)."""
    if setting == "auto":
        return "w4" if str(device).startswith("cuda") else "bf16"
    return setting


def model_name(spec: str) -> str:
    """Short name of a model spec: directory basename or the random:* spec itself."""
    if spec.startswith("random:"):
        return spec
    return Path(spec.rstrip("/")).name or spec


def queue_name(model: str, prefix: str = "canvasq") -> str:
    """One queue per model: workers of one model never receive another model's chunks."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_name(model)).strip("-").lower() or "model"
    return f"{prefix}.{slug}"


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&;#\s]*(?:password|passwd|pwd|secret|token)[^=&;#\s]*=)([^&;#\s]*)")


_HOST_AFTER = re.compile(r"[A-Za-z0-9._~\-\[\]:%,]*(?:[/?#;]|$)")


def _mask_one(url: str) -> str:
    scheme, _, rest = url.partition("://")
    # The userinfo ends at the last `@` that a host follows: a password may hold an unencoded `@`,
    # `/`, `:`, `?` or `#`. When in doubt this masks too much (a host), never too little.
    at = next(
        (i for i in range(len(rest) - 1, -1, -1) if rest[i] == "@" and _HOST_AFTER.match(rest, i + 1)), -1
    )
    if at >= 0:
        user, colon, password = rest[:at].partition(":")
        if colon and password:
            rest = f"{user}:***{rest[at:]}"
    return f"{scheme}://{_SECRET_PARAM.sub(lambda m: m[1] + '***', rest)}"


def mask_url(text: str) -> str:
    """Every URL in `text` with its password masked, in every form: `postgresql://u:secret@h/db` ->
    `postgresql://u:***@h/db`, an unencoded `@` inside the password, and query parameters such as
    `?password=` / `&sslpassword=` / `?token=`. Text without a secret comes back unchanged."""
    return _URL.sub(lambda m: _mask_one(m[0]), text)


def settings_error_line(exc: Exception) -> str | None:
    """One line naming the CANVASQ_* variable(s) behind a settings failure, or None when `exc` is
    not one (a pydantic ValidationError of Settings, or pydantic-settings' SettingsError)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    if isinstance(exc, SettingsError):
        m = re.search(r'field "([^"]+)"', str(exc))
        var = f"CANVASQ_{m[1].upper()}" if m else "a CANVASQ_* variable"
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        return f"bad setting {var}: cannot parse its value{cause}"
    if isinstance(exc, ValidationError) and exc.title == Settings.__name__:
        parts = []
        for e in exc.errors(include_url=False):
            var = "CANVASQ_" + "_".join(str(p) for p in e["loc"][:1]).upper()
            msg = e["msg"].removeprefix("Value error, ")
            parts.append(f"{var}={e.get('input')!r}: {msg}" if e["type"] != "missing" else f"{var}: {msg}")
        return "bad setting " + "; ".join(parts)
    return None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reload_settings() -> Settings:
    get_settings.cache_clear()
    return get_settings()
