"""Prometheus metrics (prometheus_client) of a worker process. No label is ever a request, run or
file id: statuses and states come from fixed sets.

Worker (`CANVASQ_METRICS_PORT` set: an HTTP server on that port in the worker process), this
process's own counts:
  canvasq_worker_requests_total{status}, canvasq_worker_committed_tokens_total,
  canvasq_worker_forwards_total, canvasq_worker_generation_seconds_total,
  canvasq_worker_chunks_total{state}, canvasq_worker_decode_steps_total,
  canvasq_worker_slot_steps_busy_total / canvasq_worker_slot_steps_total (slot occupancy =
  their rates' ratio), canvasq_worker_window_rows_total (rows per forward, against the decode
  steps), canvasq_worker_decode_slots, canvasq_worker_model_load_seconds, canvasq_worker_info{device,model}.
  Per-GPU throughput is rate(canvasq_worker_committed_tokens_total) by instance.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        reg = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "canvasq_worker_requests", "Rows this worker wrote, by status", ["status"], registry=reg
        )
        self.tokens = Counter(
            "canvasq_worker_committed_tokens", "Completion tokens this worker wrote", registry=reg
        )
        self.forwards = Counter(
            "canvasq_worker_forwards", "Model passes that served a row, summed over rows", registry=reg
        )
        self.gen_s = Counter(
            "canvasq_worker_generation_seconds", "Rows' shares of decode wall time", registry=reg
        )
        self.chunks = Counter(
            "canvasq_worker_chunks", "Chunks processed, by claim state", ["state"], registry=reg
        )
        self.steps = Counter(
            "canvasq_worker_decode_steps", "Decode steps of the continuous-batching loop", registry=reg
        )
        self.busy = Counter(
            "canvasq_worker_slot_steps_busy", "Sum over steps of the slots holding a row", registry=reg
        )
        self.slot_steps = Counter(
            "canvasq_worker_slot_steps", "Sum over steps of the decode slots", registry=reg
        )
        self.slots = Gauge("canvasq_worker_decode_slots", "Decode slots of the last step", registry=reg)
        self.load_s = Gauge(
            "canvasq_worker_model_load_seconds", "Time to load (and pack) the model at start", registry=reg
        )
        self.window_rows = Counter(
            "canvasq_worker_window_rows",
            "Window rows of the passes that served a row, "
            "each row's own share (rows per forward = its rate / decode steps' rate)",
            registry=reg,
        )
        self.info = Gauge(
            "canvasq_worker_info",
            "This worker (value 1): its device and model",
            ["device", "model"],
            registry=reg,
        )

    def instrument(self, engine) -> None:
        """Count what `engine` writes and processes (wraps its store's write_results and its
        process_chunk on the instance; nothing else changes)."""
        write, process = engine.store.write_results, engine.process_chunk

        def write_results(run_id, records, worker_id=None):
            written = write(run_id, records, worker_id)
            if written == len(records):  # a redelivery writes fewer: those rows were counted before
                for r in records:
                    self.requests.labels(r.status).inc()
                    self.tokens.inc(r.completion_tokens if r.status == "done" else 0)
                    self.forwards.inc(r.forwards)
                    self.gen_s.inc(r.gen_ms / 1000)
                    self.window_rows.inc(sum(t.get("own_rows") or 0 for t in r.traces))
            return written

        def process_chunk(chunk_id):
            summary = process(chunk_id)
            self.chunks.labels(str(summary.state)).inc()
            occ = summary.occupancy
            if occ:
                self.steps.inc(len(occ))
                self.busy.inc(sum(n for n, _ in occ))
                self.slot_steps.inc(sum(k for _, k in occ))
                self.slots.set(occ[-1][1])
            return summary

        engine.store.write_results, engine.process_chunk = write_results, process_chunk

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)


def start_worker_metrics(engine, load_s: float | None = None) -> WorkerMetrics | None:
    """In a worker process: metrics on CANVASQ_METRICS_PORT when it is set (one port per worker)."""
    port = os.environ.get("CANVASQ_METRICS_PORT")
    if not port:
        return None
    from canvasq.core.settings import model_name

    m = WorkerMetrics()
    m.instrument(engine)
    m.info.labels(str(getattr(engine, "device", "?")), model_name(engine.settings.model)).set(1)
    if load_s is not None:
        m.load_s.set(load_s)
    try:
        m.serve(int(port), os.environ.get("CANVASQ_METRICS_ADDR", "0.0.0.0"))
        log.info("worker metrics on :%s/metrics", port)
    except OSError as exc:
        log.warning("worker metrics not served on port %s: %s", port, exc)
    return m
