"""Batches: an `api_batches` row over one run. What a stock OpenAI client sees is built here.

Status (OpenAI's names) from the batch row and its run:
  validating   the row exists, its input is being checked (no run yet)
  failed       the input had errors (`errors.data`: one {code, line, message} per line error)
  in_progress  the run is queued or running
  cancelling   the run is cancelling
  finalizing   the run ended; the output and error files are being written
  completed | cancelled | expired   the run ended that way and its files exist

The files are written by the server's `Finalizer`, a background thread of every server process (a
conditional UPDATE picks one writer across processes), or by the cancel route when the run has already
ended; reads never write (a GET of an ended batch says `finalizing` until its files exist). Expired
rows are `batch_expired` and cancelled ones `batch_cancelled` in the error file, so every custom_id of
the input is in exactly one of the two files.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import cast

from sqlalchemy import select, update

from canvasq.core.schemas import OPENAI_URLS, Limits, ValidationReport, iter_jobs, validate_file
from canvasq.core.settings import DECODERS, Settings, model_name
from canvasq.core.tables import ApiBatch, ApiFile, Run, utcnow
from canvasq.serve.config import ServeSettings
from canvasq.serve.files import ApiError, FileStore, new_file_id, unix_ts
from canvasq.serve.objects import (
    Batch,
    BatchErrors,
    BatchRequestCounts,
    BatchStatus,
    BatchUsage,
    CanvasqBatch,
    RunProgress,
)

log = logging.getLogger(__name__)

ERROR_CODES = {"expired": "batch_expired", "cancelled": "batch_cancelled"}
RUN_ENDED = ("completed", "cancelled", "expired")
_WINDOW = re.compile(r"(\d{1,7})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DECODER_METADATA_KEY = "canvasq_decoder"


def window_seconds(window: str, max_s: int) -> int:
    m = _WINDOW.fullmatch(window or "")
    if not m or int(m[1]) == 0:
        raise ApiError(
            400,
            f"completion_window {window!r}: expected a duration such as 24h (also s, m, d)",
            param="completion_window",
        )
    secs = int(m[1]) * _UNIT_S[m[2]]
    if secs > max_s:
        raise ApiError(
            400,
            f"completion_window {window!r} is longer than the limit of {max_s} s",
            param="completion_window",
        )
    return secs


def check_metadata(meta: dict | None) -> dict | None:
    if meta is None:
        return None
    if len(meta) > 16:
        raise ApiError(400, "metadata has more than 16 keys", param="metadata")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise ApiError(
                400,
                "metadata keys are strings of at most 64 characters, values strings of at most 512",
                param="metadata",
            )
    return meta


def report_errors(report: ValidationReport) -> list[dict]:
    out = [
        {"code": str(e.code), "line": e.line or None, "message": e.message, "param": None}
        for e in report.errors
    ]
    if report.errors_dropped:
        out.append(
            {
                "code": "too_many_errors",
                "line": None,
                "param": None,
                "message": f"... and {report.errors_dropped} more errors",
            }
        )
    return out


def check_request(
    endpoint: str, completion_window: str, metadata: dict | None, decoder: str | None, max_window_s: int
) -> tuple[int, dict | None, str]:
    """A create request's fields checked before any file is read: (window_s, metadata, decoder), the
    decoder from the body, else metadata `canvasq_decoder`, else auto."""
    if endpoint not in OPENAI_URLS:
        raise ApiError(
            400,
            f"endpoint {endpoint!r} is not supported; supported: {', '.join(OPENAI_URLS)}",
            param="endpoint",
        )
    window_s = window_seconds(completion_window, max_window_s)
    metadata = check_metadata(metadata)
    decoder = decoder or (metadata or {}).get(DECODER_METADATA_KEY) or "auto"
    if decoder not in DECODERS:
        raise ApiError(400, f"unknown decoder {decoder!r}; known: {', '.join(DECODERS)}", param="decoder")
    return window_s, metadata, decoder


class Batches:
    """Create, read, list, cancel and finalise batches of one store."""

    def __init__(
        self,
        store,
        files: FileStore,
        settings: Settings,
        serve: ServeSettings,
        publish: Callable[[list[str], str], None],
        queue: str,
    ):
        self.store, self.files, self.settings, self.serve = store, files, settings, serve
        self.publish, self.queue = publish, queue
        self.limits = Limits.for_model(settings)

    # -- create ------------------------------------------------------------------------------------
    def create(
        self,
        project: str,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict | None,
        decoder: str | None,
        output_expires_s: int | None = None,
    ) -> Batch:
        """POST /v1/batches: the request checked, a `validating` row, then its run or `failed`;
        `output_expires_s`: its output and error files expire that long after they are written."""
        window_s, metadata, decoder = check_request(
            endpoint, completion_window, metadata, decoder, self.serve.max_completion_window_s
        )
        f = self._input_file(project, input_file_id)
        batch_id = self._insert_validating(
            project, f, endpoint, completion_window, metadata, window_s, output_expires_s
        )
        path = self.files.path_of(f)
        report = validate_file(path, self.limits)  # the same checks, line for line, as `canvasq submit`
        if not report.ok:
            self._mark_invalid(batch_id, report)
        else:
            self._start_run(batch_id, f, path, decoder, window_s)
        return self.get(project, batch_id)

    def _input_file(self, project: str, input_file_id: str) -> ApiFile:
        """The project's batch file, or 404 as if another project's file did not exist."""
        f = self.files.get(project, input_file_id)
        if f is None:
            raise ApiError(404, f"No such File object: {input_file_id}", param="input_file_id")
        if f.purpose != "batch":
            raise ApiError(
                400,
                f"file {input_file_id} has purpose {f.purpose!r}; a batch needs purpose 'batch'",
                param="input_file_id",
            )
        return f

    def _insert_validating(
        self,
        project: str,
        f: ApiFile,
        endpoint: str,
        completion_window: str,
        metadata: dict | None,
        window_s: int,
        output_expires_s: int | None = None,
    ) -> str:
        """The batch row, committed before its file is checked so a GET meanwhile says `validating`."""
        now = utcnow()
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        with self.store.Session.begin() as s:
            s.add(
                ApiBatch(
                    id=batch_id,
                    project=project,
                    input_file_id=f.id,
                    endpoint=endpoint,
                    completion_window=completion_window,
                    meta=metadata,
                    created_at=now,
                    expires_at=now + timedelta(seconds=window_s),
                    output_expires_s=output_expires_s,
                )
            )
        return batch_id

    def _mark_invalid(self, batch_id: str, report: ValidationReport) -> None:
        """A batch whose input had errors is `failed` with them, and never gets a run."""
        with self.store.Session.begin() as s:
            s.execute(
                update(ApiBatch)
                .where(ApiBatch.id == batch_id)
                .values(errors=report_errors(report), failed_at=utcnow())
            )

    def _start_run(self, batch_id: str, f: ApiFile, path: Path, decoder: str, window_s: int) -> None:
        """The batch's run, linked to its row, then its chunks published."""
        created = self.store.create_run(
            iter_jobs(path, self.limits),
            model=self.settings.model,
            queue=self.queue,
            decoder=decoder,
            chunk_size=self.settings.chunk_size,
            name=f"{batch_id} ({f.filename})"[:200],
            idempotency_key=f"api:{batch_id}",
            input_path=f"file:{f.id}",
            input_sha256=f.sha256,
            deadline_s=window_s,
        )
        with self.store.Session.begin() as s:
            s.execute(update(ApiBatch).where(ApiBatch.id == batch_id).values(run_id=created.run_id))
        try:  # rows are committed first: a chunk the broker missed is published by reconcile
            self.publish(created.chunk_ids, self.queue)
            self.store.mark_published(created.chunk_ids)
        except Exception as exc:  # noqa: BLE001 - the batch exists; the workers' reconcile publishes it
            log.warning(
                "batch %s: publishing its chunks failed (%s); reconcile will publish them", batch_id, exc
            )

    # -- read --------------------------------------------------------------------------------------
    def _row(self, project: str, batch_id: str) -> tuple[ApiBatch, Run | None]:
        with self.store.Session() as s:
            row = s.execute(
                select(ApiBatch, Run)
                .outerjoin(Run, Run.id == ApiBatch.run_id)
                .where(ApiBatch.id == batch_id, ApiBatch.project == project)
            ).first()
        if row is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", param="batch_id")
        return row[0], row[1]

    def get(self, project: str, batch_id: str) -> Batch:
        return self._objects([self._row(project, batch_id)])[0]

    def list(self, project: str, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page, newest first, in a fixed number of queries however long the page."""
        with self.store.Session() as s:
            q = (
                select(ApiBatch, Run)
                .outerjoin(Run, Run.id == ApiBatch.run_id)
                .where(ApiBatch.project == project)
            )
            if after:
                seq = s.scalar(select(ApiBatch.seq).where(ApiBatch.id == after, ApiBatch.project == project))
                if seq is None:
                    raise ApiError(400, f"no batch {after!r} to page after", param="after")
                q = q.where(ApiBatch.seq < seq)
            rows = [(b, run) for b, run in s.execute(q.order_by(ApiBatch.seq.desc()).limit(limit + 1))]
        return self._objects(rows[:limit]), len(rows) > limit

    def _objects(self, rows: builtins.list[tuple[ApiBatch, Run | None]]) -> builtins.list[Batch]:
        summaries = self.store.run_summaries([run for _, run in rows if run is not None])
        return [self.to_object(b, run, summaries.get(run.id) if run is not None else None) for b, run in rows]

    def cancel(self, project: str, batch_id: str) -> Batch:
        b, run = self._row(project, batch_id)
        if run is None or run.status in RUN_ENDED:
            if run is not None and b.finished_at is None:  # ended: its files first, then the answer
                self.finalize(b, run)
            obj = self.get(project, batch_id)
            if obj.status in ("cancelling", "cancelled"):
                return obj
            raise ApiError(409, f"Cannot cancel a batch with status {obj.status!r}", param="batch_id")
        with self.store.Session.begin() as s:
            s.execute(
                update(ApiBatch)
                .where(ApiBatch.id == batch_id, ApiBatch.cancelling_at.is_(None))
                .values(cancelling_at=utcnow())
            )
        self.store.cancel_run(run.id)  # queued chunks now, running ones between decoder steps
        b, run = self._row(project, batch_id)
        assert run is not None  # the batch's run, found above
        if run.status in RUN_ENDED:  # nothing was running: cancelled at once
            self.finalize(b, run)
        return self.get(project, batch_id)

    # -- finalise ----------------------------------------------------------------------------------
    def finalize_ended(self) -> int:
        """Write the files of every batch whose run has ended (every project); returns how many."""
        with self.store.Session() as s:
            rows = s.execute(
                select(ApiBatch, Run)
                .join(Run, Run.id == ApiBatch.run_id)
                .where(Run.status.in_(RUN_ENDED), ApiBatch.finished_at.is_(None))
                .order_by(ApiBatch.seq)
            ).all()
        for b, run in rows:
            self.finalize(b, run)
        return len(rows)

    def finalize(self, b: ApiBatch, run: Run) -> None:
        """Write the ended run's output and error files (once, across server processes)."""
        from canvasq.core.results import write_results  # the lines `canvasq results` writes

        with self.store.Session.begin() as s:
            s.execute(
                update(ApiBatch)
                .where(ApiBatch.id == b.id, ApiBatch.finalizing_at.is_(None))
                .values(finalizing_at=utcnow())
            )
        tmp_out, tmp_err = self.files.tmp_path(), self.files.tmp_path()
        try:
            with open(tmp_out, "w", encoding="utf-8") as out, open(tmp_err, "w", encoding="utf-8") as err:
                n_ok, n_err = write_results(self.store, run, out, err, ordered=True, error_codes=ERROR_CODES)
            out_id = new_file_id() if n_ok else None
            err_id = new_file_id() if n_err else None
            with self.store.Session.begin() as s:
                res = s.execute(
                    update(ApiBatch)
                    .where(ApiBatch.id == b.id, ApiBatch.finished_at.is_(None))
                    .values(output_file_id=out_id, error_file_id=err_id, finished_at=utcnow())
                )
                if res.rowcount != 1:  # another process finalised it first
                    return
                for fid, tmp, n, kind in (
                    (out_id, tmp_out, n_ok, "output"),
                    (err_id, tmp_err, n_err, "error"),
                ):
                    if fid:
                        self.files.add(
                            b.project,
                            tmp,
                            filename=f"{b.id}_{kind}.jsonl",
                            purpose="batch_output",
                            nbytes=tmp.stat().st_size,
                            lines=n,
                            sha256=_sha256(tmp),
                            file_id=fid,
                            session=s,
                            expires_s=b.output_expires_s,
                        )
        finally:
            tmp_out.unlink(missing_ok=True)
            tmp_err.unlink(missing_ok=True)

    # -- the object --------------------------------------------------------------------------------
    def to_object(self, b: ApiBatch, run: Run | None, summary: dict | None) -> Batch:
        """The OpenAI Batch object of `b` over `run` and its `Reports.run_summaries` entry."""
        status: BatchStatus
        if b.failed_at is not None:
            status = "failed"
        elif run is None:
            status = "validating"
        elif b.finished_at is not None:  # RUN_ENDED's run statuses are Batch statuses too
            status = cast(BatchStatus, run.status) if run.status in RUN_ENDED else "completed"
        elif run.status in RUN_ENDED:
            status = "finalizing"
        elif run.status == "cancelling":
            status = "cancelling"
        else:
            status = "in_progress"
        ended_at = {st: unix_ts(b.finished_at) if status == st else None for st in RUN_ENDED}
        counts, usage, extension = BatchRequestCounts(total=0, completed=0, failed=0), None, None
        if summary is not None:
            assert run is not None  # a summary is its run's
            c = summary["counts"]
            counts = BatchRequestCounts(
                total=c["total"], completed=c["done"], failed=c["errored"] + c["expired"] + c["cancelled"]
            )
            usage = BatchUsage(
                input_tokens=summary["prompt_tokens"],
                output_tokens=summary["completion_tokens"],
                total_tokens=summary["prompt_tokens"] + summary["completion_tokens"],
            )
            extension = CanvasqBatch(
                run_id=run.id,
                run_status=run.status,
                decoder=run.decoder,
                counts=c,
                progress=RunProgress.model_validate(summary),
            )
        return Batch(
            id=b.id,
            endpoint=b.endpoint,
            model=model_name(run.model) if run else None,
            errors=BatchErrors(data=b.errors) if b.errors else None,
            input_file_id=b.input_file_id,
            completion_window=b.completion_window,
            status=status,
            output_file_id=b.output_file_id,
            error_file_id=b.error_file_id,
            created_at=unix_ts(b.created_at),
            in_progress_at=unix_ts(run.created_at) if run is not None else None,
            expires_at=unix_ts(b.expires_at),
            finalizing_at=unix_ts(b.finalizing_at),
            completed_at=ended_at["completed"],
            failed_at=unix_ts(b.failed_at),
            expired_at=ended_at["expired"],
            cancelling_at=unix_ts(b.cancelling_at),
            cancelled_at=ended_at["cancelled"],
            request_counts=counts,
            metadata=b.meta,
            usage=usage,
            canvasq=extension,
        )


class Finalizer:
    """The server's writer of ended batches' files: a thread that runs `Batches.finalize_ended` at start
    and every `every_s` seconds, so that no read has to write; each pass also deletes the files past
    their `expires_at` (`FileStore.delete_expired`)."""

    def __init__(self, batches: Batches, every_s: float):
        self.batches, self.every_s = batches, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="canvasq-finalizer", daemon=True)

    def start(self) -> Finalizer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.batches.finalize_ended()
                self.batches.files.delete_expired()
            except Exception as exc:  # noqa: BLE001 - a store or disk outage: the next pass tries again
                log.warning("finalizing ended batches failed (%s); retrying in %.1f s", exc, self.every_s)
            self._stop.wait(self.every_s)


def _sha256(path) -> str:
    from canvasq.core.db import file_sha256

    return file_sha256(path)
