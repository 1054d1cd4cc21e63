"""The ground floor: what the worker, the Batch API and the CLI share.

settings (one typed Settings from CANVASQ_*), statuses (row status enums), schemas (input lines →
`Job`), tables (SQL tables), db (engine, migrations), queue (`QueueStore`: the queue protocol and the
records that cross rooms: `ClaimedChunk`, `ClaimedRequest`, `ResultRecord`), reports (`Reports`:
read-only queries), store (`Store`: both), results (OpenAI batch output lines), calibrations (stored
calibrations). It imports the decoders, model and kernels below it, never the worker, serve or cli
above it (docs/CONTRACTS.md, "Floors").
"""
