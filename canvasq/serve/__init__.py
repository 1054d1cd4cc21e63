"""`canvasq serve`: OpenAI's Files and Batches API over the store and the queue.

Flow: POST /v1/files (multipart, streamed to the files directory under size and line limits) →
POST /v1/batches (the file validated by `schemas.iter_validated`, a run created and its chunks
published exactly as `canvasq submit` does) → workers → GET /v1/batches/{id} (status and counts read
from the run's rows; GET routes never write) → once the run is over, the server's finalizer thread
writes its output and error files once by `core.results.write_results`, as `canvasq results` writes
them → GET /v1/files/{id}/content.

Modules: config (ServeSettings), keys (bearer keys, hashed at rest), files (streamed upload, the
files directory), objects (the typed answers: Batch, FileObject, pages), batches (create / cancel /
finalise, the Batch object of a row and its run), app (the FastAPI routes),
local_worker (the `--with-worker` child: one `worker.engine.Engine` draining its queue from SQL); the
`serve` and `keys` commands live in `canvasq.cli.serve`.
"""
