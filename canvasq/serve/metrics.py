"""Prometheus metrics (prometheus_client) of `canvasq serve`. No label is ever a
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

The worker's own metrics are `canvasq.worker.metrics`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class _StoreFigures:
    """One scrape's reads from the store, taken in one session."""

    runs: dict[str, int]
    depth: int
    finished: dict[str, int]
    tokens: int
    forwards: int
    online: int


class StoreCollector:
    """Fleet-wide figures read from SQL (and the broker's queue length) at scrape time."""

    def __init__(self, store, settings, queue: str | None):
        self.store, self.settings, self.queue = store, settings, queue

    def collect(self):
        from canvasq.core.statuses import REQUEST_TERMINAL

        f = self._read_store()
        g = GaugeMetricFamily("canvasq_runs", "Runs per status", labels=["status"])
        for st in ("queued", "running", "completed", "cancelling", "cancelled", "expired", "interrupted"):
            g.add_metric([st], f.runs.get(st, 0))
        yield g
        yield GaugeMetricFamily(
            "canvasq_queue_depth_requests", "Request rows queued in active runs", value=f.depth
        )
        g = GaugeMetricFamily(
            "canvasq_requests_finished", "Terminal request rows per status", labels=["status"]
        )
        for st in REQUEST_TERMINAL:
            g.add_metric([st], f.finished.get(st, 0))
        yield g
        yield CounterMetricFamily(
            "canvasq_committed_tokens", "Completion tokens of every stored output", value=f.tokens
        )
        yield CounterMetricFamily(
            "canvasq_forwards",
            "Model passes that served a request, summed over requests",
            value=f.forwards,
        )
        yield GaugeMetricFamily("canvasq_workers_online", "Workers with a recent heartbeat", value=f.online)
        broker = self._broker_queue()
        if broker is not None:
            yield broker

    def _read_store(self) -> _StoreFigures:
        """Every SQL figure of a scrape, read in one session so they describe the same moment."""
        from datetime import UTC

        from sqlalchemy import func, select

        from canvasq.core.statuses import REQUEST_TERMINAL, RUN_ACTIVE
        from canvasq.core.tables import Output, Request, Run, Worker, utcnow

        with self.store.Session() as s:
            runs = dict(s.execute(select(Run.status, func.count()).group_by(Run.status)).all())
            depth = (
                s.scalar(
                    select(func.count())
                    .select_from(Request)
                    .join(Run, Run.id == Request.run_id)
                    .where(Run.status.in_(RUN_ACTIVE), Request.status == "queued")
                )
                or 0
            )
            finished = dict(
                s.execute(
                    select(Request.status, func.count())
                    .where(Request.status.in_(REQUEST_TERMINAL))
                    .group_by(Request.status)
                ).all()
            )
            tokens, forwards = s.execute(
                select(
                    func.coalesce(func.sum(Output.completion_tokens), 0),
                    func.coalesce(func.sum(Output.forwards), 0),
                ).where(Output.error_code.is_(None))
            ).one()
            cutoff = utcnow().timestamp() - self.settings.offline_after_s
            beats = list(s.scalars(select(Worker.heartbeat_at)))
        online = sum(1 for hb in beats if hb.replace(tzinfo=UTC).timestamp() >= cutoff)
        return _StoreFigures(runs, depth, finished, int(tokens), int(forwards), online)

    def _broker_queue(self) -> GaugeMetricFamily | None:
        """Chunk messages waiting in Redis (fleet mode only); None when the broker does not answer."""
        if not self.queue or self.queue.startswith("local:"):
            return None
        try:
            import redis

            r = redis.Redis.from_url(self.settings.broker_url, socket_timeout=2)
            try:
                n = int(r.llen(self.queue))
            finally:
                r.close()
            g = GaugeMetricFamily(
                "canvasq_broker_queue_messages", "Chunk messages waiting in the broker", labels=["queue"]
            )
            g.add_metric([self.queue], n)
            return g
        except Exception as exc:  # noqa: BLE001 a broker that does not answer leaves the metric out
            log.debug("broker queue length: %s", exc)
            return None


def server_registry(store, settings, queue: str | None) -> tuple[CollectorRegistry, Counter]:
    reg = CollectorRegistry()
    http = Counter(
        "canvasq_http_requests",
        "HTTP requests answered by canvasq serve",
        ["method", "route", "status"],
        registry=reg,
    )
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
