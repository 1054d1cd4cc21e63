"""The Files API's storage: uploads streamed to the files directory under size and line limits, and
the `api_files` rows that own them.

An upload is parsed as it arrives (python-multipart's push parser over the request stream): the
`file` part goes straight to a temporary file in the files directory, counted as it goes, so the
server holds one network chunk of it at a time. A declared Content-Length over the limit is refused
before a byte is read; a body without one is refused at the first chunk past the limit, and at the
first line past the line limits. The temporary file is removed whatever ends the upload early.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, cast, overload

from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy import delete, or_, select

from canvasq.core.tables import ApiFile, utcnow
from canvasq.serve.objects import FileObject, FilePurpose

MULTIPART_OVERHEAD = 64 * 1024  # boundaries, part headers and the small fields beside the file
MAX_FIELD_BYTES = 4096  # `purpose` and any other non-file field
MIN_EXPIRES_S, MAX_EXPIRES_S = 3600, 30 * 86400  # OpenAI's bounds of an `expires_after` policy


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


@dataclass
class _Part:
    name: str | None = None
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class UploadSink:
    """Receives the multipart body chunk by chunk; the `file` part goes to `tmp_path`."""

    def __init__(self, boundary: bytes, tmp_path: Path, max_bytes: int, max_lines: int, max_line_bytes: int):
        self.tmp_path, self.max_bytes, self.max_lines, self.max_line_bytes = (
            tmp_path,
            max_bytes,
            max_lines,
            max_line_bytes,
        )
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.bytes = 0
        self.lines = 0  # complete lines seen (newlines)
        self.line_len = 0  # bytes of the line in progress
        self.sha = hashlib.sha256()
        self._fh: IO[bytes] | None = None
        self._part = _Part()
        self._hname = bytearray()
        self._hvalue = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self.parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_header_field": self._hfield,
                "on_header_value": self._hval,
                "on_header_end": self._hend,
                "on_headers_finished": self._headers_done,
                "on_part_data": self._data,
                "on_part_end": self._end,
            },
        )

    # -- parser callbacks --------------------------------------------------------------------------
    def _begin(self) -> None:
        self._part, self._headers = _Part(), {}

    def _hfield(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def _hval(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _hend(self) -> None:
        self._headers[bytes(self._hname).lower()] = bytes(self._hvalue)
        self._hname.clear()
        self._hvalue.clear()

    def _headers_done(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = params.get(b"name")
        self._part.name = name.decode("utf-8", "replace") if name is not None else None
        fname = params.get(b"filename")
        self._part.filename = fname.decode("utf-8", "replace") if fname is not None else None
        if self._part.name == "file":
            if self._fh is not None:
                raise ApiError(400, "more than one `file` part in the upload", param="file")
            self.filename = (self._part.filename or "upload.jsonl")[:255]
            self._fh = open(self.tmp_path, "wb")  # noqa: SIM115 - closed in finish / abort

    def _data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._part.name != "file":
            self._part.data += chunk
            if len(self._part.data) > MAX_FIELD_BYTES:
                raise ApiError(
                    400,
                    f"form field {self._part.name!r} is longer than {MAX_FIELD_BYTES} bytes",
                    param=self._part.name,
                )
            return
        self.bytes += len(chunk)
        if self.bytes > self.max_bytes:
            raise ApiError(
                413,
                f"file is larger than the limit of {self.max_bytes} bytes",
                code="file_too_large",
                param="file",
            )
        self._count_lines(chunk)
        self.sha.update(chunk)
        assert self._fh is not None  # opened with the `file` part's headers
        self._fh.write(chunk)

    def _count_lines(self, chunk: bytes) -> None:
        pos = 0
        while True:
            nl = chunk.find(b"\n", pos)
            seg = (nl if nl >= 0 else len(chunk)) - pos
            self.line_len += seg
            if self.line_len > self.max_line_bytes + 1:  # + 1: a CR before the newline
                raise ApiError(
                    400,
                    f"line {self.lines + 1} is longer than {self.max_line_bytes} bytes",
                    code="line_too_long",
                    param="file",
                )
            if nl < 0:
                break
            self.lines += 1
            self.line_len = 0
            if self.lines > self.max_lines:
                raise ApiError(
                    413, f"file has more than {self.max_lines} lines", code="too_many_lines", param="file"
                )
            pos = nl + 1

    def _end(self) -> None:
        if self._part.name and self._part.name != "file":
            self.fields[self._part.name] = self._part.data.decode("utf-8", "replace")

    # -- life --------------------------------------------------------------------------------------
    def write(self, chunk: bytes) -> None:
        self.parser.write(chunk)

    def finish(self) -> None:
        self.parser.finalize()
        if self._fh is None:
            raise ApiError(400, "the upload has no `file` part", param="file")
        self._fh.close()
        self._fh = None
        if self.line_len:  # a last line without a newline
            self.lines += 1
            if self.lines > self.max_lines:
                raise ApiError(
                    413, f"file has more than {self.max_lines} lines", code="too_many_lines", param="file"
                )

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.tmp_path.unlink(missing_ok=True)


def boundary_of(content_type: str) -> bytes:
    ctype, params = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise ApiError(400, "expected a multipart/form-data upload with `file` and `purpose` fields")
    return params[b"boundary"]


def check_declared_length(content_length: str | None, max_bytes: int) -> None:
    """Refuse before reading when the client declares a body larger than the file limit allows."""
    if content_length is None:
        return
    try:
        n = int(content_length)
    except ValueError:
        raise ApiError(400, "bad Content-Length header") from None
    if n > max_bytes + MULTIPART_OVERHEAD:
        raise ApiError(
            413,
            f"upload of {n} bytes is larger than the limit of {max_bytes} bytes",
            code="file_too_large",
            param="file",
        )


# ---------------------------------------------------------------------------------------- rows


class FileStore:
    """api_files rows and the bytes under `root`."""

    def __init__(self, store, root: str | Path):
        self.store = store
        self.root = Path(root).absolute()
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # prompts and outputs: the owner's only, like a SQLite store

    def tmp_path(self) -> Path:
        return self.root / "tmp" / f"{uuid.uuid4().hex}.part"

    def path_of(self, f: ApiFile) -> Path:
        return self.root / f.path

    def add(
        self,
        project: str,
        tmp: Path,
        *,
        filename: str,
        purpose: FilePurpose,
        nbytes: int,
        lines: int,
        sha256: str,
        file_id: str | None = None,
        session=None,
        expires_s: int | None = None,
    ) -> ApiFile:
        """Move `tmp` into place and insert its row (in `session` when given, else its own); with
        `expires_s`, the file expires that many seconds after it is made."""
        file_id = file_id or new_file_id()
        rel = f"{file_id}.jsonl"
        os.replace(tmp, self.root / rel)
        now = utcnow()
        row = ApiFile(
            id=file_id,
            project=project,
            filename=filename,
            purpose=purpose,
            bytes=nbytes,
            lines=lines,
            sha256=sha256,
            path=rel,
            created_at=now,
            expires_at=now + timedelta(seconds=expires_s) if expires_s is not None else None,
        )
        if session is not None:
            session.add(row)
            return row
        with self.store.Session.begin() as s:
            s.add(row)
        return row

    def get(self, project: str, file_id: str) -> ApiFile | None:
        with self.store.Session() as s:
            return s.scalar(select(ApiFile).where(ApiFile.id == file_id, ApiFile.project == project, _live()))

    def list(
        self, project: str, *, after: str | None, limit: int, order: str, purpose: str | None
    ) -> tuple[list[ApiFile], bool]:
        with self.store.Session() as s:
            q = select(ApiFile).where(ApiFile.project == project, _live())
            if purpose:
                q = q.where(ApiFile.purpose == purpose)
            if after:
                seq = s.scalar(select(ApiFile.seq).where(ApiFile.id == after, ApiFile.project == project))
                if seq is None:
                    raise ApiError(400, f"no file {after!r} to page after", param="after")
                q = q.where(ApiFile.seq < seq if order == "desc" else ApiFile.seq > seq)
            q = q.order_by(ApiFile.seq.desc() if order == "desc" else ApiFile.seq).limit(limit + 1)
            rows = list(s.scalars(q))
        return rows[:limit], len(rows) > limit

    def delete(self, project: str, file_id: str) -> bool:
        with self.store.Session.begin() as s:
            row = s.scalar(select(ApiFile).where(ApiFile.id == file_id, ApiFile.project == project))
            if row is None:
                return False
            s.execute(delete(ApiFile).where(ApiFile.seq == row.seq))
        (self.root / row.path).unlink(missing_ok=True)
        return True

    def delete_expired(self) -> int:
        """Delete every file (any project) past its `expires_at`, row and bytes; returns how many."""
        with self.store.Session.begin() as s:
            rows = list(s.scalars(select(ApiFile).where(ApiFile.expires_at <= utcnow())))
            if rows:
                s.execute(delete(ApiFile).where(ApiFile.seq.in_([r.seq for r in rows])))
        for row in rows:
            (self.root / row.path).unlink(missing_ok=True)
        return len(rows)


def _live():
    """The files not yet expired (an expired file is gone for every route, deleted or not yet)."""
    return or_(ApiFile.expires_at.is_(None), ApiFile.expires_at > utcnow())


def expires_seconds(anchor: object, seconds: object, param: str) -> int:
    """An `expires_after` policy ({anchor: "created_at", seconds: 3600 .. 2592000}) checked: its seconds."""
    if anchor != "created_at":
        raise ApiError(400, f"{param}.anchor must be 'created_at', got {anchor!r}", param=f"{param}.anchor")
    try:
        secs = int(str(seconds))
    except ValueError:
        secs = -1
    if not MIN_EXPIRES_S <= secs <= MAX_EXPIRES_S:
        raise ApiError(
            400,
            f"{param}.seconds must be an integer from {MIN_EXPIRES_S} to {MAX_EXPIRES_S}, got {seconds!r}",
            param=f"{param}.seconds",
        )
    return secs


def file_object(f: ApiFile) -> FileObject:
    return FileObject(
        id=f.id,
        bytes=f.bytes,
        created_at=unix_ts(f.created_at),
        filename=f.filename,
        purpose=cast(FilePurpose, f.purpose),
        expires_at=unix_ts(f.expires_at),
    )  # the column holds only what `add` was given


@overload
def unix_ts(dt: datetime) -> int: ...
@overload
def unix_ts(dt: datetime | None) -> int | None: ...
def unix_ts(dt: datetime | None) -> int | None:
    """Seconds since the epoch of one of the store's (naive UTC) datetimes, as the API objects carry them."""
    return int(dt.replace(tzinfo=UTC).timestamp()) if dt is not None else None
