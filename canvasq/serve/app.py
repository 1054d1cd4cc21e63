"""The FastAPI application: OpenAI's Files and Batches routes (its OpenAPI schema at /openapi.json,
docs at /docs). Every route but /health needs `Authorization: Bearer <key>`; a key sees only its
project's files and batches, and anything else is 404, as if it did not exist.

Handlers are plain functions (FastAPI runs them in its thread pool, beside the synchronous store),
except the upload, which reads the request stream itself so that it can refuse early.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from canvasq.core.settings import Settings, get_settings
from canvasq.serve.auth import Who
from canvasq.serve.batches import DECODER_METADATA_KEY, Batches, Finalizer
from canvasq.serve.config import ServeSettings, serve_settings
from canvasq.serve.files import (
    ApiError,
    FileStore,
    UploadSink,
    boundary_of,
    check_declared_length,
    expires_seconds,
    file_object,
)
from canvasq.serve.keys import Principal
from canvasq.serve.metrics import HttpMetrics, server_registry
from canvasq.serve.objects import Batch, FileDeleted, FileObject, Page

log = logging.getLogger(__name__)


class BatchCreate(BaseModel):
    """POST /v1/batches. `decoder` is canvasq's extension (also accepted as metadata
    `canvasq_decoder`): auto, official, hf, pipe or funnel for every line without its own."""

    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None  # {anchor: created_at, seconds}: the output files expire
    decoder: str | None = Field(
        None, description=f"canvasq: decoder for the batch (or metadata {DECODER_METADATA_KEY})"
    )


def create_app(
    store,
    *,
    settings: Settings | None = None,
    serve: ServeSettings | None = None,
    publish=None,
    queue: str | None = None,
    on_shutdown=(),
) -> FastAPI:
    """The app over `store`. `publish(chunk_ids, queue)` sends a new run's chunks (default: Celery,
    to the model's queue); `canvasq serve --with-worker` passes one that leaves them to its worker."""
    settings = settings or get_settings()
    serve = serve or serve_settings()
    if publish is None:
        from canvasq.worker.celery_app import publish_chunks

        def publish(chunk_ids, q):
            publish_chunks(chunk_ids, q, settings)

    files = FileStore(store, serve.files_dir)
    batches = Batches(store, files, settings, serve, publish, queue or settings.queue_for())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        finalizer = Finalizer(batches, serve.finalize_every_s).start()  # ended batches' files; GETs only read
        yield
        finalizer.stop()
        for fn in on_shutdown:
            fn()

    app = FastAPI(
        title="canvasq",
        version="1",
        summary="OpenAI-compatible Files and Batches API for canvasq runs",
        lifespan=lifespan,
    )
    app.state.store, app.state.files, app.state.batches = store, files, batches
    registry, http_counter = server_registry(store, settings, batches.queue)
    app.add_middleware(HttpMetrics, counter=http_counter)
    _error_handlers(app)
    _service_routes(app, registry)

    from canvasq.serve.dashboard import register as register_dashboard

    register_dashboard(app, store, batches)
    _file_routes(app, files, settings, serve)
    _batch_routes(app, batches, serve)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's error shape."""

    @app.exception_handler(ApiError)
    def _api_error(_req, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    def _invalid(_req, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        err = ApiError(
            400,
            f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}",
            param=".".join(loc) or None,
        )
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    def _http(_req, exc: StarletteHTTPException):
        err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _service_routes(app: FastAPI, registry) -> None:
    @app.get("/health", include_in_schema=False)
    def health():
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    def metrics():
        """Prometheus text format; no key needed (no ids, prompts or outputs in it)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _upload_request_body() -> dict:
    """The upload's multipart schema for OpenAPI: the handler reads the raw stream, so FastAPI cannot
    infer the body from its signature."""
    return {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }


def _check_upload(sink: UploadSink) -> str:
    """Refuse what a batch could never use, before the file is stored; its filename when accepted."""
    purpose = sink.fields.get("purpose")
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported; canvasq stores purpose 'batch' files",
            param="purpose",
        )
    if sink.bytes == 0:
        raise ApiError(400, "the file is empty", param="file")
    filename = sink.filename
    assert filename is not None  # finish() refuses an upload without a `file` part
    return filename


def _upload_expiry(sink: UploadSink) -> int | None:
    """The upload's `expires_after` policy (form fields `expires_after[anchor]`, `[seconds]`), or None."""
    anchor, seconds = sink.fields.get("expires_after[anchor]"), sink.fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    return expires_seconds(anchor, seconds, "expires_after")


def _upload_route(app: FastAPI, files: FileStore, settings: Settings, serve: ServeSettings) -> None:
    """POST /v1/files: streamed to a temporary file so an oversized upload is refused early."""

    @app.post(
        "/v1/files",
        summary="Upload a file (multipart: file, purpose=batch)",
        response_model=FileObject,
        openapi_extra={"requestBody": _upload_request_body()},
    )
    async def upload_file(request: Request, who: Who):
        import anyio

        check_declared_length(request.headers.get("content-length"), serve.max_upload_bytes)
        sink = UploadSink(
            boundary_of(request.headers.get("content-type", "")),
            files.tmp_path(),
            serve.max_upload_bytes,
            serve.max_upload_lines,
            settings.max_line_bytes,
        )
        try:
            async for chunk in request.stream():  # parsed and written off the event loop
                await anyio.to_thread.run_sync(sink.write, chunk)
            sink.finish()
            filename = _check_upload(sink)
            expires_s = _upload_expiry(sink)
            row = await anyio.to_thread.run_sync(
                lambda: files.add(
                    who.project,
                    sink.tmp_path,
                    filename=filename,
                    purpose="batch",
                    nbytes=sink.bytes,
                    lines=sink.lines,
                    sha256=sink.sha.hexdigest(),
                    expires_s=expires_s,
                )
            )
        except BaseException:
            sink.abort()
            raise
        return file_object(row)


def _file_routes(app: FastAPI, files: FileStore, settings: Settings, serve: ServeSettings) -> None:
    """The Files routes; the upload is registered first, so routes and schema keep their order."""
    _upload_route(app, files, settings, serve)

    @app.get("/v1/files", summary="List files", response_model=Page[FileObject])
    def list_files(
        who: Who,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = serve.default_page_limit,
        order: Literal["asc", "desc"] = "desc",
        purpose: str | None = None,
    ):
        rows, more = files.list(who.project, after=after, limit=limit, order=order, purpose=purpose)
        return Page[FileObject].of([file_object(f) for f in rows], more)

    def _file(who: Principal, file_id: str):
        f = files.get(who.project, file_id)
        if f is None:
            raise ApiError(404, f"No such File object: {file_id}", param="file_id")
        return f

    @app.get("/v1/files/{file_id}", summary="Retrieve a file", response_model=FileObject)
    def retrieve_file(file_id: str, who: Who):
        return file_object(_file(who, file_id))

    @app.get("/v1/files/{file_id}/content", summary="The file's bytes")
    def file_content(file_id: str, who: Who):
        f = _file(who, file_id)
        return FileResponse(files.path_of(f), media_type="application/jsonl", filename=f.filename)

    @app.delete("/v1/files/{file_id}", summary="Delete a file", response_model=FileDeleted)
    def delete_file(file_id: str, who: Who):
        if not files.delete(who.project, file_id):
            raise ApiError(404, f"No such File object: {file_id}", param="file_id")
        return FileDeleted(id=file_id, deleted=True)


def _batch_routes(app: FastAPI, batches: Batches, serve: ServeSettings) -> None:
    @app.post("/v1/batches", summary="Create a batch from an uploaded file", response_model=Batch)
    def create_batch(body: BatchCreate, who: Who):
        after = body.output_expires_after
        expires_s = (
            None
            if after is None
            else expires_seconds(after.get("anchor"), after.get("seconds"), "output_expires_after")
        )
        return batches.create(
            who.project,
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
            decoder=body.decoder,
            output_expires_s=expires_s,
        )

    @app.get("/v1/batches", summary="List batches, newest first", response_model=Page[Batch])
    def list_batches(
        who: Who,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = serve.default_page_limit,
    ):
        data, more = batches.list(who.project, after=after, limit=limit)
        return Page[Batch].of(data, more)

    @app.get("/v1/batches/{batch_id}", summary="Retrieve a batch", response_model=Batch)
    def retrieve_batch(batch_id: str, who: Who):
        return batches.get(who.project, batch_id)

    @app.post(
        "/v1/batches/{batch_id}/cancel",
        summary="Cancel a batch (finished rows are kept)",
        response_model=Batch,
    )
    def cancel_batch(batch_id: str, who: Who):
        return batches.cancel(who.project, batch_id)
