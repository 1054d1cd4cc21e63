"""Fault harness for the reliability scenarios (T1–T21 in RELIABILITY.md) and the soak script.

Real services only: `services` starts private `redis-server` / PostgreSQL instances on free ports
(destructive scenarios stop and restart them without touching the machine's shared services) and a
TCP proxy that can refuse connections; `workers` starts and signals `canvasq worker` subprocesses;
`checks` holds the exactly-once check every scenario ends with; `waiting` the deadline-bounded
wait-for helpers (safety limits, never timing assertions).
"""
