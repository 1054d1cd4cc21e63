"""The engine: one per worker process, started once, then fed chunks.

    engine = Engine(settings, store, worker_id=..., queue=...)
    engine.start()                  # load the model bundle, build its runtime and graphs (a warm-up
                                    # decode on a GPU), register the worker, start the heartbeat
                                    # (and, for a fleet worker, the reconcile loop and metrics)
    engine.run_chunk(chunk_id)      # claim, decode and store one chunk under its renewed lease
    engine.stop()

The three drivers differ only in where chunk ids come from and where results go: the Celery worker
(`worker.tasks`: broker messages; `start_process` in each child), `canvasq run` (`cli.embedded`: the
run's pending chunks, then an output file) and `canvasq serve --with-worker` (`serve.local_worker`:
its queue polled in SQL). No Celery import here; torch is imported only when the model is loaded.

Flow of a chunk: chunk id → claim in SQL (attempts + 1, lease) → its still-`queued` rows → per decoder
route → `worker.streams` (tokenise, decode, store each row as it ends) → chunk done → run finalised
when no row is left queued.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from canvasq.core.queue import QueueStore
from canvasq.core.records import ClaimedRequest, ClaimState
from canvasq.core.settings import Settings, get_settings, mask_url, model_name, resolve_experts
from canvasq.core.statuses import RequestStatus, RunStatus
from canvasq.decoders.types import DecodeResult
from canvasq.worker import faults, streams
from canvasq.worker.devices import bind_cuda_device, resolve_device

if TYPE_CHECKING:
    from canvasq.worker.ahead import AheadFeeder

log = logging.getLogger(__name__)

DecodeFn = Callable[..., list[DecodeResult]]


def default_decode_fn() -> DecodeFn:
    from canvasq.decoders import run_batch

    return run_batch


@dataclass
class ChunkSummary:
    """What `Engine.process_chunk` did with one chunk."""

    chunk: str
    state: str  # the claim's `ClaimState` (work, empty, exhausted, cancelled, missing, busy)
    attempt: int | None = None
    written: int = 0  # rows stored by this delivery
    occupancy: list[tuple[int, int]] = field(default_factory=list)  # (live rows, slots) per decoder step
    claimed_ahead: int = 0  # the run's later chunks fed into this chunk's stream


class Engine:
    """One worker process's engine: settings, store, the model bundle and its runtime, the worker's
    liveness (registration, heartbeat, leases) and the chunk loop. See the module docstring."""

    def __init__(
        self,
        settings: Settings | None = None,
        store: QueueStore | None = None,
        bundle: Any = None,
        decode_fn: DecodeFn | None = None,
        worker_id: str | None = None,
        queue: str | None = None,
        stop_poll_s: float = 1.0,
    ):
        self.settings = settings or get_settings()
        self.store = store or QueueStore.from_settings(self.settings)
        self._bundle = bundle
        self._decode_fn = decode_fn
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.queue = queue or self.settings.queue_for()
        self.device = os.environ.get("CUDA_VISIBLE_DEVICES") or "cpu"
        self.stop_poll_s = stop_poll_s  # how often should_stop re-reads the run's status
        # Exceptions that end the chunk instead of erroring a batch (the Celery task sets its soft
        # time limit here; this module never imports Celery). Passed to the decoders, which raise
        # `Interrupted` from one instead of turning it into row errors.
        self.interrupts: tuple[type[BaseException], ...] = ()
        self.on_row: Callable[[], None] | None = None  # called as each streamed row finishes (progress)
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._rc_thread: threading.Thread | None = None
        self.holding_chunk: str | None = None  # the chunk whose lease each heartbeat renews (`holding`)
        self.ahead_chunks: set[str] = set()  # chunks claimed ahead into the running stream (renewed too)
        self.slot_cap: int | None = None  # set by `shrink_slots` after a stream ran out of device memory

    # -- process lifetime --------------------------------------------------------------------------
    @property
    def bundle(self):
        if self._bundle is None:
            from canvasq.model.loading import freeze_heap, load_bundle

            device = resolve_device(self.settings.device)
            if self.settings.torch_threads:
                import torch

                torch.set_num_threads(self.settings.torch_threads)
            bind_cuda_device(device)
            experts = resolve_experts(self.settings.experts, device)
            t0 = time.perf_counter()
            self._bundle = load_bundle(
                self.settings.model, device=device, experts=experts, cache_dir=self.settings.w4_cache_dir
            )
            freeze_heap()  # the model's objects are the process's: no full collection walks them again
            log.info(
                "loaded %s on %s in %.1fs (experts %s)",
                self.settings.model,
                device,
                time.perf_counter() - t0,
                experts,
            )
            self.device = device
        return self._bundle

    @property
    def experts(self) -> str:
        """CANVASQ_EXPERTS resolved for the loaded model's device (what `load_bundle` packed)."""
        return resolve_experts(self.settings.experts, str(getattr(self.bundle, "device", "cpu")))

    @property
    def decode_fn(self) -> DecodeFn:
        if self._decode_fn is None:
            self._decode_fn = default_decode_fn()
        return self._decode_fn

    def register(self) -> None:
        self.store.register_worker(
            self.worker_id,
            socket.gethostname(),
            os.getpid(),
            self.device,
            self.settings.model,
            self.queue,
        )

    def start_heartbeat(self) -> None:
        """Every heartbeat_s: the worker row's heartbeat, and the lease of the chunk in hand renewed
        to now + lease_s. The lease lapses only when this thread stops beating: the process died
        (or cannot reach the store), and `reconcile` re-publishes the chunk."""

        def beat():
            while not self._hb_stop.wait(self.settings.heartbeat_s):
                chunks = [c for c in (self.holding_chunk, *list(self.ahead_chunks)) if c]
                try:
                    self.store.heartbeat(self.worker_id, chunks, self.settings.lease_s)
                except Exception as exc:  # noqa: BLE001 a missed beat is not worth killing the worker
                    log.warning("heartbeat failed: %s", mask_url(str(exc)))

        self._hb_thread = threading.Thread(target=beat, name="canvasq-heartbeat", daemon=True)
        self._hb_thread.start()

    @contextlib.contextmanager
    def holding(self, chunk_id: str):
        """Work on `chunk_id` with its lease renewed by the heartbeat; renewal ends with the block,
        whatever ended it (a chunk left `running` by a failed delivery then lapses and is re-published)."""
        self.holding_chunk = chunk_id
        try:
            yield
        finally:
            self.holding_chunk = None
            self.ahead_chunks.clear()  # chunks claimed ahead and cut short lapse and are re-published

    def start_reconciler(self) -> None:
        """The fleet's reconcile pass, every reconcile_s, in its own thread so a long pass never
        delays a heartbeat; one worker per interval wins a lock in Redis and runs it."""
        if not self.settings.reconcile_s:
            return
        from canvasq.worker.reconcile import reconcile_loop

        self._rc_thread = threading.Thread(
            target=reconcile_loop,
            args=(self.store, self.settings, self._hb_stop, self.worker_id),
            name="canvasq-reconcile",
            daemon=True,
        )
        self._rc_thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and reconcile threads and wait for them (a store call in flight ends
        first), so nothing of this worker runs on while its process exits."""
        self._hb_stop.set()
        for t in (self._hb_thread, self._rc_thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=self.settings.heartbeat_s)

    def load(self) -> Any:
        """The model bundle, loaded now (a load failure raises here, before any chunk is claimed)."""
        return self.bundle

    def warm(self) -> None:
        """Build the default route's decoder now: its runtime (W4 packs, FP8 copies) and, where its
        forwards replay graphs, the graph runner's arena for `decode_slots` rows, with one short
        decode, so Triton compiles and graph captures happen at start rather than inside the first
        chunk's time limit."""
        from canvasq.decoders.registry import make_decoder
        from canvasq.decoders.slots import drain
        from canvasq.decoders.types import DecodeRequest

        s, bundle = self.settings, self.bundle
        dec = make_decoder(
            "official", bundle, None, s.cuda_graphs, self.experts, fp8=s.fp8, fp8_min_rows=s.fp8_min_rows
        )
        if dec.graphs is None:
            return
        req = DecodeRequest("warm-up", bundle.encode_prompt("warm up", None), s.default_max_tokens, None)
        drain(dec, [req], self.decode_slots)

    def start(self, *, reconcile: bool = False, metrics: bool = False) -> Self:
        """Register this worker and start its heartbeat (and, with `reconcile`, the fleet's reconcile
        loop), then load and warm the model (already loaded: kept), then with `metrics` serve its
        Prometheus endpoint (CANVASQ_METRICS_PORT). Registered first, a worker whose load is slow or
        fails shows as alive in `canvasq workers`."""
        self.register()
        self.start_heartbeat()
        if reconcile:
            self.start_reconciler()
        t0 = time.perf_counter()
        self.load()
        self.warm()
        if metrics:
            from canvasq.worker.metrics import start_worker_metrics

            start_worker_metrics(self, time.perf_counter() - t0)
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run_chunk(self, chunk_id: str) -> ChunkSummary:
        """One chunk under its lease (renewed by the heartbeat while it runs)."""
        with self.holding(chunk_id):
            return self.process_chunk(chunk_id)

    # -- one chunk ---------------------------------------------------------------------------------
    def _stopper(self, run_id: str) -> Callable[[], bool]:
        """`should_stop` for the decoder: the run's cancelling flag, read at most every stop_poll_s."""
        read_at, stop = 0.0, False

        def should_stop() -> bool:
            nonlocal read_at, stop
            now = time.monotonic()
            if not stop and now - read_at >= self.stop_poll_s:
                read_at = now
                try:
                    stop = self.store.run_status(run_id) in (
                        RunStatus.cancelling,
                        RunStatus.cancelled,
                        RunStatus.expired,
                    )
                except Exception as exc:  # noqa: BLE001 a flaky read never stops generation
                    log.debug("cancel-flag read failed: %s", exc)
            return stop

        return should_stop

    def process_chunk(self, chunk_id: str) -> ChunkSummary:
        s = self.settings
        claim = self.store.claim_chunk(chunk_id, self.worker_id, s.lease_s, s.max_attempts)
        summary = ChunkSummary(chunk_id, claim.state, claim.attempts)
        if claim.state == ClaimState.missing:
            log.warning("chunk %s not in the store; dropping the message", chunk_id)
            return summary
        run_id = claim.run_id
        assert run_id is not None
        if claim.state == ClaimState.busy:  # claimed ahead by a live worker: its message, not a delivery
            log.info(
                "chunk %s is being decoded by another worker (claimed ahead); dropping the message", chunk_id
            )
            return summary
        if claim.state != ClaimState.work:
            if claim.state != ClaimState.exhausted:
                self.store.finish_chunk(chunk_id)
            self.store.finalize_run(run_id)
            return summary
        if model_name(claim.model or "") != model_name(s.model):
            log.warning("chunk %s is for model %s; this worker serves %s", chunk_id, claim.model, s.model)

        self._decode_chunk(claim, summary)
        self.store.finish_chunk(chunk_id)
        self.store.finalize_run(run_id)
        return summary

    def _decode_chunk(self, claim, summary: ChunkSummary) -> None:
        """A claimed chunk's rows through their decoders (streams, then batched decoders), then a run
        cancelled or expired meanwhile closes the rows left."""
        s, run_id, chunk_id = self.settings, claim.run_id, summary.chunk
        should_stop = self._stopper(run_id)
        t0 = time.monotonic()
        routes, batched = [], []
        for decoder, rows in self.by_decoder(claim).items():
            if self._decode_fn is None and decoder != "hf":  # the production path: continuous batching
                routes += self.routed(decoder, rows)
            else:
                batched.append((decoder, rows))
        feeders: list[AheadFeeder] = []
        for i, (name, knobs, part) in enumerate(routes):
            if should_stop():
                break
            # the chunk's last stream may take the run's next chunks ahead, for half the soft time limit
            ahead = (
                t0 + s.soft_time_limit / 2
                if i == len(routes) - 1 and not batched and self.claims_ahead
                else None
            )
            summary.written += streams.stream_and_store(
                self, run_id, name, knobs, part, should_stop, summary, ahead_until=ahead, feeders=feeders
            )
        for decoder, rows in batched:
            for i in range(0, len(rows), s.decode_batch_size):
                if should_stop():
                    break
                summary.written += streams.decode_and_store(
                    self, run_id, decoder, rows[i : i + s.decode_batch_size], should_stop
                )
        code = None
        if should_stop():
            status = self.store.run_status(run_id)
            code = RequestStatus.expired if status == RunStatus.expired else RequestStatus.cancelled
            self.store.close_chunk_rows(chunk_id, run_id, code, code, f"run {status}")
        for feeder in feeders:
            feeder.close(code)
            summary.claimed_ahead += feeder.claimed

    @staticmethod
    def by_decoder(claim) -> dict[str, list[ClaimedRequest]]:
        """A claimed chunk's rows per decoder asked for: the row's own, else the run's, else auto."""
        groups: dict[str, list[ClaimedRequest]] = {}
        for r in claim.requests:
            groups.setdefault(r.decoder or claim.run_decoder or "auto", []).append(r)
        return groups

    @property
    def claims_ahead(self) -> bool:
        """CANVASQ_CLAIM_AHEAD resolved: auto = a fleet worker on a GPU (not an embedded run)."""
        mode = self.settings.claim_ahead
        if mode == "off" or (self.queue or "").startswith(("embedded:", "local:")):  # one chunk per run there
            return False
        return mode == "on" or str(getattr(self.bundle, "device", "cpu")).startswith("cuda")

    @property
    def decode_slots(self) -> int:
        """Requests in flight per decode stream: the setting, else by device: 64 on a GPU with at least
        120 GiB (an H200: 64 x 256 rows fit beside the arena with the LM head read by row group, and
        beat 32 in rows/s, BENCHMARKS.md "Service throughput"), 32 on a smaller GPU, decode_batch_size
        on CPU; at most half the count a stream ran out of memory with (`shrink_slots`)."""
        configured = self._configured_slots()
        return configured if self.slot_cap is None else min(configured, self.slot_cap)

    def _configured_slots(self) -> int:
        if self.settings.decode_slots:
            return self.settings.decode_slots
        device = str(getattr(self.bundle, "device", "cpu"))
        if not device.startswith("cuda"):
            return self.settings.decode_batch_size
        import torch

        return (
            64 if torch.cuda.get_device_properties(torch.device(device)).total_memory >= 120 * 2**30 else 32
        )

    def shrink_slots(self, after: int) -> int:
        """A decode stream ran out of device memory at `after` slots: this process decodes with half
        as many from now on (the rows in flight are fed again, `streams.decode_stream`). Returns the
        new count."""
        self.slot_cap = max(1, after // 2)
        log.warning(
            "out of device memory with %d decode slots: %d from now on in this worker "
            "(CANVASQ_DECODE_SLOTS sets the count)",
            after,
            self.slot_cap,
        )
        return self.slot_cap

    @property
    def calibration(self):
        """The newest calibration of this worker's model (`canvasq calibrate`), read once per process;
        None when there is none (auto then routes to official) or it cannot be read."""
        if "_calibration" not in self.__dict__:
            from canvasq.core.calibrations import load_for_model

            try:
                self._calibration = load_for_model(self.store, self.settings.model)
            except Exception as exc:  # noqa: BLE001 no calibration is a safe answer: official
                log.warning(
                    "calibration for %s not readable (%s); --decoder auto uses official",
                    self.settings.model,
                    exc,
                )
                self._calibration = None
            if self._calibration is not None:
                log.info("--decoder auto routes by %s", self._calibration.describe())
        return self._calibration

    def routed(
        self, decoder: str, rows: list[ClaimedRequest]
    ) -> list[tuple[str, dict, list[ClaimedRequest]]]:
        """(decoder, knobs, rows) per route: `auto` resolved per row's task (decoders.routing)."""
        if decoder != "auto":
            return [(decoder, {}, rows)]
        from canvasq.decoders.routing import group_by_route

        groups = group_by_route(
            [r.task for r in rows],
            self.settings.routing or None,
            self.calibration,
            self.settings.routing_budget,
        )
        return [(name, knobs, [rows[i] for i in idx]) for name, knobs, idx in groups]

    def tokenize(self, rows: list[ClaimedRequest], decoder: str):
        """`streams.tokenize` for this engine: DecodeRequests and the errored records of refused rows."""
        return streams.tokenize(self, rows, decoder)

    def abandon_chunk(self, chunk_id: str, code: str, message: str) -> None:
        """Soft time limit: rows done so far stay, the rest become errored(`code`); no redelivery."""
        run_id = chunk_id.rsplit("-", 1)[0]
        self.store.close_chunk_rows(chunk_id, run_id, RequestStatus.errored, code, message)
        self.store.record_chunk_error(chunk_id, message)
        self.store.finish_chunk(chunk_id)
        self.store.finalize_run(run_id)


# ---------------------------------------------------------------------------------------- per process

_ENGINE: Engine | None = None


def get_engine() -> Engine:
    """The Celery child's engine (one per process)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = Engine(queue=os.environ.get("CANVASQ_WORKER_QUEUE") or None)
    return _ENGINE


def start_process() -> None:
    """In the Celery worker child: start its engine (never in the parent: CUDA is touched only here)."""
    engine = get_engine()
    engine.store.engine.dispose(close=False)  # never share pooled connections across fork
    if faults.install_replay():  # inert unless CANVASQ_TEST_REPLAY is set
        log.warning("replaying recorded schedules from %s", os.environ["CANVASQ_TEST_REPLAY"])
    try:
        engine.start(reconcile=True, metrics=bool(os.environ.get("CANVASQ_METRICS_PORT")))
        log.info("canvasq child ready: %s", engine.worker_id)
    except Exception:
        log.exception("model load failed; chunks will retry the load")


def stop_process() -> None:
    if _ENGINE is not None:
        _ENGINE.stop()
