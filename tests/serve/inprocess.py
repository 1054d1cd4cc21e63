"""The Batch API in this process over a real store: `create_app` behind Starlette's TestClient, not
entered as a context manager, so the app's lifespan (the finalizer thread) does not run and nothing
writes behind a test's back. Runs are driven to their end through the store, as a worker would."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from fastapi.testclient import TestClient

from canvasq.core.queue import ResultRecord
from canvasq.core.settings import Settings
from canvasq.serve.app import create_app
from canvasq.serve.config import ServeSettings
from canvasq.serve.keys import create_key
from tests.harness.backends import model_for_tests
from tests.harness.server import ENDPOINT


@dataclass
class Api:
    client: TestClient
    headers: dict[str, str]
    files_dir: Path

    @property
    def batches(self):
        return self.client.app.state.batches

    def upload(self, data: bytes) -> str:
        res = self.client.post(
            "/v1/files",
            headers=self.headers,
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", io.BytesIO(data), "application/jsonl")},
        )
        assert res.status_code == 200, res.text
        return res.json()["id"]

    def create(self, data: bytes) -> dict:
        res = self.client.post(
            "/v1/batches",
            headers=self.headers,
            json={"input_file_id": self.upload(data), "endpoint": ENDPOINT, "completion_window": "24h"},
        )
        assert res.status_code == 200, res.text
        return res.json()

    def get(self, path: str, **params):
        return self.client.get(path, headers=self.headers, params=params)


def in_process_api(store, tmp_path: Path, project: str = "alpha") -> Api:
    files_dir = tmp_path / "files"
    settings = Settings(model=model_for_tests(), database_url=store.url, chunk_size=4)
    app = create_app(
        store,
        settings=settings,
        serve=ServeSettings(files_dir=str(files_dir)),
        publish=lambda _ids, _queue: None,
        queue="canvasq.test.inprocess",
    )
    _, token = create_key(store, project)
    return Api(TestClient(app), {"Authorization": f"Bearer {token}"}, files_dir)


def finish_run(store, run_id: str, errored: int = 0) -> None:
    """Every row of the run answered (the first `errored` with an error), the run completed."""
    worker = "test-worker"
    for cid in store.pending_chunks(run_id):
        claim = store.claim_chunk(cid, worker, 60, 3)
        records = []
        for r in claim.requests:
            if errored > 0:
                errored -= 1
                records.append(
                    ResultRecord(
                        r.custom_id,
                        status="errored",
                        error_code="decode_error",
                        error_message="boom",
                        decoder="official",
                    )
                )
            else:
                records.append(
                    ResultRecord(
                        r.custom_id,
                        text="4",
                        token_ids=[7],
                        finish_reason="stop",
                        prompt_tokens=12,
                        completion_tokens=1,
                        forwards=3,
                        decoder="official",
                        traces=[
                            {
                                "forward_index": 0,
                                "rows": 1,
                                "commits": 1,
                                "canvases": 1,
                                "states": "full",
                                "ms": 1.0,
                                "kind": "decode",
                            }
                        ],
                    )
                )
        store.write_results(run_id, records, worker)
        store.finish_chunk(cid)
    assert store.finalize_run(run_id) == "completed"
