"""Test-only harnesses: the fault harness for the reliability scenarios (T1–T21 in RELIABILITY.md) and
scripts/soak.py, and `backends` (the real PostgreSQL / Redis helpers every service test uses).

Real services only:
- `services`: private `redis-server` / PostgreSQL instances on free ports (destructive scenarios stop
  and restart them without touching the machine's shared services) and a TCP proxy that can refuse
  connections;
- `workers`: `canvasq worker` subprocesses to signal (whole worker or its pool child);
- `scenario`: one scenario's world (Redis, store, queue, workers, the CLI as a subprocess);
- `checks`: the exactly-once check every scenario ends with; `probes`: read-only store/broker views;
- `waiting`: deadline-bounded wait-for helpers (safety limits, never timing assertions).

Worker-side fault injection lives in `canvasq.worker.faults` (inert unless CANVASQ_TEST_* is set).
"""
