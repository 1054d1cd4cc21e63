"""Prometheus metrics (prometheus_client) of `canvasq serve` and of the workers. No label is ever a
request, run or file id: routes are templates, statuses come from fixed sets.

Server (`GET /metrics` on the API port), read from the store at each scrape, so every server of a
fleet shows the fleet:
  canvasq_http_requests_total{method,route,status}     answered HTTP requests
  canvasq_runs{status}                                 runs per status
  canvasq_queue_depth_requests                         request rows queued in active runs
  canvasq_requests_finished{status}                    terminal request rows (done, errored, ...)
  canvasq_committed_tokens_total                       completion tokens of every stored output
  canvasq_forwards_total                               model passes that served a request, summed
  canvasq_workers_online                               workers with a heartbeat within offline_after_s
  canvasq_broker_queue_messages{queue}                 chunk messages waiting in Redis (fleet mode)

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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- server


class StoreCollector:
    """Fleet-wide figures read from SQL (and the broker's queue length) at scrape time."""

    def __init__(self, store, settings, queue: str | None):
        self.store, self.settings, self.queue = store, settings, queue

    def collect(self):
        from sqlalchemy import func, select

        from canvasq.api.models import REQUEST_TERMINAL, RUN_ACTIVE, Output, Request, Run, Worker, utcnow

        with self.store.Session() as s:
            runs = dict(s.execute(select(Run.status, func.count()).group_by(Run.status)).all())
            depth = s.scalar(select(func.count()).select_from(Request).join(Run, Run.id == Request.run_id)
                             .where(Run.status.in_(RUN_ACTIVE), Request.status == "queued")) or 0
            finished = dict(s.execute(select(Request.status, func.count()).where(Request.status.in_(REQUEST_TERMINAL))
                                      .group_by(Request.status)).all())
            tokens, forwards = s.execute(select(func.coalesce(func.sum(Output.completion_tokens), 0),
                                                func.coalesce(func.sum(Output.forwards), 0))
                                         .where(Output.error_code.is_(None))).one()
            cutoff = utcnow().timestamp() - self.settings.offline_after_s
            beats = list(s.scalars(select(Worker.heartbeat_at)))
        g = GaugeMetricFamily("canvasq_runs", "Runs per status", labels=["status"])
        for st in ("queued", "running", "completed", "cancelling", "cancelled", "expired", "interrupted"):
            g.add_metric([st], runs.get(st, 0))
        yield g
        yield GaugeMetricFamily("canvasq_queue_depth_requests", "Request rows queued in active runs", value=depth)
        g = GaugeMetricFamily("canvasq_requests_finished", "Terminal request rows per status", labels=["status"])
        for st in REQUEST_TERMINAL:
            g.add_metric([st], finished.get(st, 0))
        yield g
        yield CounterMetricFamily("canvasq_committed_tokens", "Completion tokens of every stored output",
                                  value=int(tokens))
        yield CounterMetricFamily("canvasq_forwards", "Model passes that served a request, summed over requests",
                                  value=int(forwards))
        from datetime import UTC

        online = sum(1 for hb in beats if hb.replace(tzinfo=UTC).timestamp() >= cutoff)
        yield GaugeMetricFamily("canvasq_workers_online", "Workers with a recent heartbeat", value=online)
        if self.queue and not self.queue.startswith("local:"):
            try:
                import redis

                r = redis.Redis.from_url(self.settings.broker_url, socket_timeout=2)
                try:
                    n = int(r.llen(self.queue))
                finally:
                    r.close()
                g = GaugeMetricFamily("canvasq_broker_queue_messages", "Chunk messages waiting in the broker",
                                      labels=["queue"])
                g.add_metric([self.queue], n)
                yield g
            except Exception as exc:  # noqa: BLE001 a broker that does not answer leaves the metric out
                log.debug("broker queue length: %s", exc)


def server_registry(store, settings, queue: str | None) -> tuple[CollectorRegistry, Counter]:
    reg = CollectorRegistry()
    http = Counter("canvasq_http_requests", "HTTP requests answered by canvasq serve",
                   ["method", "route", "status"], registry=reg)
    reg.register(StoreCollector(store, settings, queue))
    return reg, http


class HttpMetrics:
    """ASGI middleware counting answered requests by method, route template and status."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.counter.labels(scope["method"], path, str(status["code"])).inc()


# ---------------------------------------------------------------------------------------- worker


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        reg = self.registry = registry or CollectorRegistry()
        self.requests = Counter("canvasq_worker_requests", "Rows this worker wrote, by status", ["status"],
                                registry=reg)
        self.tokens = Counter("canvasq_worker_committed_tokens", "Completion tokens this worker wrote", registry=reg)
        self.forwards = Counter("canvasq_worker_forwards", "Model passes that served a row, summed over rows",
                                registry=reg)
        self.gen_s = Counter("canvasq_worker_generation_seconds", "Rows' shares of decode wall time", registry=reg)
        self.chunks = Counter("canvasq_worker_chunks", "Chunks processed, by claim state", ["state"], registry=reg)
        self.steps = Counter("canvasq_worker_decode_steps", "Decode steps of the continuous-batching loop",
                             registry=reg)
        self.busy = Counter("canvasq_worker_slot_steps_busy", "Sum over steps of the slots holding a row",
                            registry=reg)
        self.slot_steps = Counter("canvasq_worker_slot_steps", "Sum over steps of the decode slots", registry=reg)
        self.slots = Gauge("canvasq_worker_decode_slots", "Decode slots of the last step", registry=reg)
        self.load_s = Gauge("canvasq_worker_model_load_seconds", "Time to load (and pack) the model at start",
                            registry=reg)
        self.window_rows = Counter("canvasq_worker_window_rows", "Window rows of the passes that served a row, "
                                   "each row's own share (rows per forward = its rate / decode steps' rate)",
                                   registry=reg)
        self.info = Gauge("canvasq_worker_info", "This worker (value 1): its device and model", ["device", "model"],
                          registry=reg)

    def instrument(self, rt) -> None:
        """Count what `rt` writes and processes (wraps its store's write_results and its
        process_chunk on the instance; nothing else changes)."""
        write, process = rt.store.write_results, rt.process_chunk

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
            self.chunks.labels(summary.get("state", "?")).inc()
            occ = summary.get("occupancy") or []
            if occ:
                self.steps.inc(len(occ))
                self.busy.inc(sum(n for n, _ in occ))
                self.slot_steps.inc(sum(k for _, k in occ))
                self.slots.set(occ[-1][1])
            return summary

        rt.store.write_results, rt.process_chunk = write_results, process_chunk

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)


def start_worker_metrics(rt, load_s: float | None = None) -> WorkerMetrics | None:
    """In a worker process: metrics on CANVASQ_METRICS_PORT when it is set (one port per worker)."""
    port = os.environ.get("CANVASQ_METRICS_PORT")
    if not port:
        return None
    from canvasq.api.settings import model_name

    m = WorkerMetrics()
    m.instrument(rt)
    m.info.labels(str(getattr(rt, "device", "?")), model_name(rt.settings.model)).set(1)
    if load_s is not None:
        m.load_s.set(load_s)
    try:
        m.serve(int(port), os.environ.get("CANVASQ_METRICS_ADDR", "0.0.0.0"))
        log.info("worker metrics on :%s/metrics", port)
    except OSError as exc:
        log.warning("worker metrics not served on port %s: %s", port, exc)
    return m
