"""Settings of `canvasq serve` (CANVASQ_* like the service's, kept apart: none of them changes what a
run generates, so none belongs to an embedded run's identity)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CANVASQ_", extra="ignore")

    # where uploaded and generated files live (one directory shared by every server of a store)
    files_dir: str = "canvasq-files"
    # an upload is refused as soon as it passes either limit, before the rest is read (OpenAI's
    # batch limits: 200 MB, 50,000 requests)
    max_upload_bytes: int = Field(
        200 * 1000 * 1000, ge=1024, le=2**31 - 1
    )  # api_files.bytes is a 32-bit column
    max_upload_lines: int = Field(50_000, ge=1)
    # the longest completion_window accepted (OpenAI accepts only 24h; shorter ones are canvasq's)
    max_completion_window_s: int = Field(7 * 24 * 3600, ge=1)
    # batch list / file list page size when the client gives no limit
    default_page_limit: int = Field(20, ge=1, le=10_000)
    # how often the server's finalizer writes the files of batches whose run has ended (a batch is
    # `finalizing` for up to this long after its last row)
    finalize_every_s: float = Field(1.0, gt=0)


def serve_settings() -> ServeSettings:
    return ServeSettings()
