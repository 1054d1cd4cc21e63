"""Runs one chunk in a worker process. No Celery import: the tasks module and the embedded
`canvasq run` both call `ChunkRuntime.process_chunk`.

Flow: chunk id → claim in SQL (attempts + 1, lease) → its still-`queued` request rows (Jobs) →
tokenised into DecodeRequests → DecodeBatch per decoder, `decode_batch_size` prompts at a time →
`canvasq.decoders.run_batch` → DecodeResults → outputs + forward traces written in one transaction
per batch (only rows still `queued`: a redelivered chunk skips done rows) → chunk done → run
finalised when no row is left queued.

The model is loaded once per process (`start_process`, called in the Celery child; CUDA is never
touched in the parent). torch is imported only when the model is loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from canvasq.core.db import retry_transient
from canvasq.core.queue import ClaimedRequest, ClaimState, QueueStore, ResultRecord
from canvasq.core.settings import Settings, get_settings, mask_url, model_name, resolve_experts
from canvasq.core.statuses import RequestStatus, RunStatus
from canvasq.decoders.types import (
    CANCELLED,
    DecodeBatch,
    DecodeRequest,
    DecodeResult,
    FinishReason,
    Interrupted,
)
from canvasq.worker import faults

log = logging.getLogger(__name__)

DecodeFn = Callable[..., list[DecodeResult]]


def resolve_device(setting: str, visible: int | None = None, current: int | None = None) -> str:
    """CANVASQ_DEVICE -> "cpu" or "cuda:N". `auto` and `cuda` take the current CUDA device (index 0 of
    what CUDA_VISIBLE_DEVICES shows, unless something selected another); `cuda:N` must be visible.
    `visible` / `current` default to what torch reports (given explicitly by the CPU tests)."""
    if setting == "cpu":
        return "cpu"
    if visible is None or current is None:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        current = torch.cuda.current_device() if visible else 0
    if setting == "auto" and not visible:
        return "cpu"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "CUDA_VISIBLE_DEVICES unset" if cvd is None else f"CUDA_VISIBLE_DEVICES={cvd!r}"
    if setting in ("auto", "cuda"):
        if not visible:
            raise ValueError(f"CANVASQ_DEVICE=cuda: no CUDA device is visible ({where}); use auto or cpu")
        return f"cuda:{current}"
    head, _, index = setting.partition(":")
    if head != "cuda" or not index.isdigit():
        raise ValueError(f"CANVASQ_DEVICE={setting!r}: expected auto, cpu, cuda or cuda:N")
    if int(index) >= visible:
        raise ValueError(f"CANVASQ_DEVICE={setting}: {visible} CUDA device(s) visible ({where}); "
                         f"N counts the visible devices from 0")
    return f"cuda:{int(index)}"


def bind_cuda_device(device: str) -> None:
    """Make `device` ("cuda" or "cuda:N") the current CUDA device. The kernels launch, and the decode
    graphs capture, on the current device's stream, so a worker pinned with CANVASQ_DEVICE=cuda:N
    (rather than CUDA_VISIBLE_DEVICES) must select N before it loads the model. `set_device` needs an
    index: a bare "cuda" keeps the current device."""
    if device.startswith("cuda"):
        import torch

        _, _, index = device.partition(":")
        torch.cuda.set_device(torch.device("cuda", int(index) if index else torch.cuda.current_device()))


def default_decode_fn() -> DecodeFn:
    from canvasq.decoders import run_batch

    return run_batch


def longest_first(reqs: list) -> list:
    """Rows (anything with `max_tokens`) in the order a stream admits them: the largest first (stable). A row's
    forwards grow with its canvases, so a long row admitted last runs on alone while the other
    slots sit empty; started first, it overlaps the short ones (longest-processing-time order).
    Replayed from a real run's forwards per row (200 mixed rows cycled to 2,000, one stream):
    64 slots 83 -> 99 % busy, 369 -> 311 steps (BENCHMARKS.md, "Decode slots per chunk size")."""
    return sorted(reqs, key=lambda q: -q.max_tokens)


def result_record(res: DecodeResult, gen_ms: float, decoder: str) -> ResultRecord:
    if res.error == CANCELLED:
        status, code = RequestStatus.cancelled, "cancelled"
    elif res.error:
        status, code = RequestStatus.errored, "decode_error"
    else:
        status, code = RequestStatus.done, None
    traces = [
        {k: v for k, v in asdict(t).items() if k != "index"} | {"forward_index": t.index} for t in res.traces
    ]
    return ResultRecord(
        custom_id=res.custom_id,
        text=res.text if not res.error or res.error == CANCELLED else None,
        token_ids=list(res.token_ids) if res.token_ids else [],
        finish_reason=res.finish_reason,
        prompt_tokens=res.prompt_tokens,
        completion_tokens=len(res.token_ids or []) if not res.error else 0,
        forwards=res.forwards,
        decoder=res.decoder or decoder,
        gen_ms=gen_ms,
        error_code=code,
        error_message=res.error if res.error else None,
        status=status,
        traces=traces,
    )


class ChunkRuntime:
    """Everything one worker process needs: settings, store, the model (lazy), a decode function."""

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

    # -- process lifetime --------------------------------------------------------------------------
    @property
    def bundle(self):
        if self._bundle is None:
            from canvasq.model.loading import load_bundle

            device = resolve_device(self.settings.device)
            if self.settings.torch_threads:
                import torch

                torch.set_num_threads(self.settings.torch_threads)
            bind_cuda_device(device)
            experts = resolve_experts(self.settings.experts, device)
            t0 = time.perf_counter()
            self._bundle = load_bundle(self.settings.model, device=device, experts=experts,
                                       cache_dir=self.settings.w4_cache_dir)
            log.info("loaded %s on %s in %.1fs (experts %s)", self.settings.model, device,
                     time.perf_counter() - t0, experts)
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
        retry_transient(
            lambda: self.store.register_worker(
                self.worker_id, socket.gethostname(), os.getpid(), self.device, self.settings.model, self.queue
            )
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

        self._rc_thread = threading.Thread(target=reconcile_loop, args=(self.store, self.settings, self._hb_stop,
                                                                        self.worker_id),
                                           name="canvasq-reconcile", daemon=True)
        self._rc_thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and reconcile threads and wait for them (a store call in flight ends
        first), so nothing of this worker runs on while its process exits."""
        self._hb_stop.set()
        for t in (self._hb_thread, self._rc_thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=self.settings.heartbeat_s)

    # -- one chunk ---------------------------------------------------------------------------------
    def _stopper(self, run_id: str) -> Callable[[], bool]:
        """`should_stop` for the decoder: the run's cancelling flag, read at most every stop_poll_s."""
        state = {"t": 0.0, "stop": False}

        def should_stop() -> bool:
            now = time.monotonic()
            if not state["stop"] and now - state["t"] >= self.stop_poll_s:
                state["t"] = now
                try:
                    state["stop"] = self.store.run_status(run_id) in (RunStatus.cancelling, RunStatus.cancelled,
                                                                       RunStatus.expired)
                except Exception as exc:  # noqa: BLE001 a flaky read never stops generation
                    log.debug("cancel-flag read failed: %s", exc)
            return state["stop"]

        return should_stop

    def process_chunk(self, chunk_id: str) -> dict[str, Any]:
        s = self.settings
        claim = retry_transient(
            lambda: self.store.claim_chunk(chunk_id, self.worker_id, s.lease_s, s.max_attempts)
        )
        summary = {"chunk": chunk_id, "state": claim.state, "attempt": claim.attempts, "written": 0}
        if claim.state == ClaimState.missing:
            log.warning("chunk %s not in the store; dropping the message", chunk_id)
            return summary
        run_id = claim.run_id
        assert run_id is not None
        if claim.state == ClaimState.busy:  # claimed ahead by a live worker: its message, not a delivery
            log.info("chunk %s is being decoded by another worker (claimed ahead); dropping the message", chunk_id)
            return summary
        if claim.state != ClaimState.work:
            if claim.state != ClaimState.exhausted:
                retry_transient(lambda: self.store.finish_chunk(chunk_id))
            retry_transient(lambda: self.store.finalize_run(run_id))
            return summary
        if model_name(claim.model or "") != model_name(s.model):
            log.warning("chunk %s is for model %s; this worker serves %s", chunk_id, claim.model, s.model)

        should_stop = self._stopper(run_id)
        t0 = time.monotonic()
        streams, batched = [], []
        for decoder, rows in self.by_decoder(claim).items():
            if self._decode_fn is None and decoder != "hf":  # the production path: continuous batching
                streams += self._routed(decoder, rows)
            else:
                batched.append((decoder, rows))
        feeders = []
        for i, (name, knobs, part) in enumerate(streams):
            if should_stop():
                break
            # the chunk's last stream may take the run's next chunks ahead, for half the soft time limit
            ahead = t0 + s.soft_time_limit / 2 if i == len(streams) - 1 and not batched and self.claims_ahead else None
            summary["written"] += self._stream_and_store(run_id, name, knobs, part, should_stop, summary,
                                                         ahead_until=ahead, feeders=feeders)
        for decoder, rows in batched:
            for i in range(0, len(rows), s.decode_batch_size):
                if should_stop():
                    break
                summary["written"] += self._decode_and_store(run_id, decoder, rows[i : i + s.decode_batch_size],
                                                             should_stop)
        code = None
        if should_stop():
            status = self.store.run_status(run_id)
            code = RequestStatus.expired if status == RunStatus.expired else RequestStatus.cancelled
            retry_transient(lambda: self.store.close_chunk_rows(chunk_id, run_id, code, code, f"run {status}"))
        for feeder in feeders:
            feeder.close(code)
            summary["claimed_ahead"] = summary.get("claimed_ahead", 0) + feeder.claimed
        retry_transient(lambda: self.store.finish_chunk(chunk_id))
        retry_transient(lambda: self.store.finalize_run(run_id))
        return summary

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
        120 GiB (an H200: 64 x 256 rows fit beside the fp32 logits and arena, and beat 32 in rows/s,
        BENCHMARKS.md "Service throughput"), 32 on a smaller GPU, decode_batch_size on CPU."""
        if self.settings.decode_slots:
            return self.settings.decode_slots
        device = str(getattr(self.bundle, "device", "cpu"))
        if not device.startswith("cuda"):
            return self.settings.decode_batch_size
        import torch

        return 64 if torch.cuda.get_device_properties(torch.device(device)).total_memory >= 120 * 2**30 else 32

    @property
    def calibration(self):
        """The newest calibration of this worker's model (`canvasq calibrate`), read once per process;
        None when there is none (auto then routes to official) or it cannot be read."""
        if "_calibration" not in self.__dict__:
            from canvasq.core.calibrations import load_for_model

            try:
                self._calibration = load_for_model(self.store, self.settings.model)
            except Exception as exc:  # noqa: BLE001 no calibration is a safe answer: official
                log.warning("calibration for %s not readable (%s); --decoder auto uses official",
                            self.settings.model, exc)
                self._calibration = None
            if self._calibration is not None:
                log.info("--decoder auto routes by %s", self._calibration.describe())
        return self._calibration

    def _routed(self, decoder: str, rows: list[ClaimedRequest]) -> list[tuple[str, dict, list[ClaimedRequest]]]:
        """(decoder, knobs, rows) per route: `auto` resolved per row's task (decoders.routing)."""
        if decoder != "auto":
            return [(decoder, {}, rows)]
        from canvasq.decoders.routing import group_by_route

        groups = group_by_route([r.task for r in rows], self.settings.routing or None, self.calibration,
                                self.settings.routing_budget)
        return [(name, knobs, [rows[i] for i in idx]) for name, knobs, idx in groups]

    def _tokenize(self, rows: list[ClaimedRequest], decoder: str) -> tuple[list[DecodeRequest], list[ResultRecord]]:
        """DecodeRequests, and an errored record for each row the tokenizer fails on (that row only)."""
        bundle, reqs, records = self.bundle, [], []
        for r in rows:
            try:
                ids = bundle.encode_prompt(r.prompt, r.task)
                reqs.append(DecodeRequest(r.custom_id, list(ids), r.max_tokens, r.task))
            except self.interrupts:
                raise
            except Exception as exc:
                records.append(ResultRecord(r.custom_id, status=RequestStatus.errored, error_code="tokenizer_error",
                                            error_message=f"{type(exc).__name__}: {exc}", decoder=decoder))
        return reqs, records

    def _stream_and_store(self, run_id: str, decoder: str, knobs: dict, rows: list[ClaimedRequest], should_stop,
                          summary: dict, ahead_until: float | None = None, feeders: list | None = None) -> int:
        """Continuous batching over `rows`: `decode_slots` requests in flight, a free slot refilled at
        once, each finished row written to the store the moment it ends (idempotent per custom_id: a
        crash loses no finished row). With `ahead_until` (a monotonic time), once `rows` are all in
        flight the run's next chunks are claimed ahead into the same stream (`worker.ahead`)."""
        from canvasq.decoders.registry import make_decoder

        bundle = self.bundle  # a load failure raises here: the chunk is retried, rows stay queued
        reqs, records = self._tokenize(rows, decoder)
        written = retry_transient(lambda: self.store.write_results(run_id, records, self.worker_id)) if records else 0
        if not reqs:
            return written
        dec = make_decoder(decoder, bundle, knobs, self.settings.cuda_graphs, self.experts,
                           fp8=self.settings.fp8, fp8_min_rows=self.settings.fp8_min_rows)
        todo = longest_first(reqs)
        fed: list[DecodeRequest] = []
        occupancy: list[tuple[int, int]] = []
        capacity = dec.capacity_for(reqs)
        feeder = None
        if ahead_until is not None:
            from canvasq.worker.ahead import AheadFeeder

            # an arena for the run's rows, not this chunk's: its longest max_tokens, prompts up to
            # 1.5x this chunk's longest (a longer row's chunk is given back to its own delivery)
            prompt = max(len(q.prompt_ids) for q in reqs) * 3 // 2
            run_max = retry_transient(lambda: self.store.max_queued_tokens(run_id))
            capacity = max(capacity, dec.need(DecodeRequest("", [0] * prompt, max(run_max, *(q.max_tokens for q in reqs)))))

            feeder = AheadFeeder(self, run_id, (decoder, knobs), dec.need, capacity, ahead_until)
            if feeders is not None:
                feeders.append(feeder)

        def feed(n: int):
            if feeder is not None and len(todo) < n and not should_stop():
                feeder.top_up(todo, n - len(todo))
                todo[:] = longest_first(todo)
            taken, todo[:] = todo[:n], todo[n:]
            fed.extend(taken)
            if taken:
                faults.before_decode(q.custom_id for q in taken)  # inert unless CANVASQ_TEST_* is set
            return [(q.custom_id, q) for q in taken]

        def on_result(key, res: DecodeResult) -> None:
            nonlocal written
            # its share of each pass that carried it (rows in flight share the wall; a sum over rows
            # of their time in flight would count it once per slot)
            ms = sum(t.ms * (t.own_rows or 0) / t.rows for t in res.traces if t.rows)
            rec = result_record(res, ms, decoder)
            written += retry_transient(lambda: self.store.write_results(run_id, [rec], self.worker_id))
            if feeder is not None:
                feeder.written(str(key))
            if self.on_row is not None:
                self.on_row()

        try:
            dec.stream(feed, on_result, slots=self.decode_slots, seed=self.settings.seed,
                       capacity=capacity, should_stop=should_stop, interrupts=self.interrupts,
                       occupancy=occupancy)
        except Interrupted as cut:  # finished rows are already stored; the task abandons the rest
            raise cut.cause from None
        except self.interrupts:
            raise
        except Exception as exc:  # deterministic failure → the rows not yet stored error, never a retry storm
            log.exception("decode stream failed for run %s", run_id)
            # every row not yet stored (write_results skips the ones that are)
            left = [*fed, *todo]  # the chunk's rows and any claimed ahead, fed or not
            failed = [result_record(DecodeResult(q.custom_id, [], "", FinishReason.error, len(q.prompt_ids), 0,
                                                 error=f"{type(exc).__name__}: {exc}"), 0.0, decoder) for q in left]
            written += retry_transient(lambda: self.store.write_results(run_id, failed, self.worker_id))
            if feeder is not None:
                for q in left:
                    feeder.written(q.custom_id)
        if occupancy:
            live = sum(n for n, _ in occupancy)
            summary.setdefault("occupancy", []).extend(occupancy)
            log.info("decode stream %s: %d rows, %d steps, slots %.0f%% full", decoder, len(reqs),
                     len(occupancy), 100 * live / sum(n for _, n in occupancy))
        return written

    def _decode_and_store(self, run_id: str, decoder: str, rows: list[ClaimedRequest], should_stop) -> int:
        bundle = self.bundle  # a load failure raises here: the chunk is retried, rows stay queued
        reqs, records = self._tokenize(rows, decoder)
        if reqs:
            t0 = time.perf_counter()
            try:
                faults.before_decode(q.custom_id for q in reqs)  # inert unless CANVASQ_TEST_* is set
                results = self.decode_fn(bundle, DecodeBatch(reqs, seed=self.settings.seed), decoder,
                                         should_stop=should_stop, routing=self.settings.routing or None,
                                         interrupts=self.interrupts, cuda_graphs=self.settings.cuda_graphs,
                                         experts=self.experts, fp8=self.settings.fp8,
                                         fp8_min_rows=self.settings.fp8_min_rows)
            except Interrupted as cut:  # keep the finished rows; the task abandons the rest of the chunk
                share = (time.perf_counter() - t0) * 1000 / len(reqs)
                done = [result_record(res, share, decoder) for res in cut.done]
                retry_transient(lambda: self.store.write_results(run_id, records + done, self.worker_id))
                raise cut.cause from None
            except self.interrupts:
                raise
            except Exception as exc:  # deterministic per-batch failure → errored rows, never a retry storm
                log.exception("decode failed for %d rows of run %s", len(reqs), run_id)
                results = [DecodeResult(q.custom_id, [], "", FinishReason.error, len(q.prompt_ids), 0,
                                        error=f"{type(exc).__name__}: {exc}") for q in reqs]
            share = (time.perf_counter() - t0) * 1000 / len(reqs)
            records += [result_record(res, share, decoder) for res in results]
        return retry_transient(lambda: self.store.write_results(run_id, records, self.worker_id))

    def abandon_chunk(self, chunk_id: str, code: str, message: str) -> None:
        """Soft time limit: rows done so far stay, the rest become errored(`code`); no redelivery."""
        run_id = chunk_id.rsplit("-", 1)[0]
        retry_transient(lambda: self.store.close_chunk_rows(chunk_id, run_id, RequestStatus.errored, code, message))
        retry_transient(lambda: self.store.record_chunk_error(chunk_id, message))
        retry_transient(lambda: self.store.finish_chunk(chunk_id))
        retry_transient(lambda: self.store.finalize_run(run_id))


# ---------------------------------------------------------------------------------------- per process

_RUNTIME: ChunkRuntime | None = None


def get_runtime() -> ChunkRuntime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = ChunkRuntime(queue=os.environ.get("CANVASQ_WORKER_QUEUE") or None)
    return _RUNTIME


def start_process() -> None:
    """In the worker child: register, start the heartbeat (and the periodic reconcile), load the model
    before the first chunk."""
    rt = get_runtime()
    rt.store.engine.dispose(close=False)  # never share pooled connections across fork
    if faults.install_replay():  # inert unless CANVASQ_TEST_REPLAY is set
        log.warning("replaying recorded schedules from %s", os.environ["CANVASQ_TEST_REPLAY"])
    rt.register()
    rt.start_heartbeat()
    rt.start_reconciler()
    try:
        rt.bundle  # noqa: B018 - load now, not inside the first chunk's time limit
        log.info("canvasq child ready: %s", rt.worker_id)
    except Exception:
        log.exception("model load failed; chunks will retry the load")


def stop_process() -> None:
    if _RUNTIME is not None:
        _RUNTIME.stop()
