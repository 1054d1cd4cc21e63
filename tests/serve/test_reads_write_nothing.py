"""GET routes write nothing: every GET route of the app (read off `app.routes`, so a new one is
covered or fails here) against a store holding batches in every state, among them one whose run has
ended and whose files are not written yet (a GET used to finalise it). Every table's rows and every
byte under the files directory are the same afterwards. The finalizer, not a read, writes the files."""

from __future__ import annotations

import hashlib

from fastapi.routing import APIRoute
from sqlalchemy import select

from canvasq.core.tables import Base
from canvasq.serve.dashboard import ASSETS
from tests.harness.server import batch_lines
from tests.serve.inprocess import finish_run, in_process_api


def _tables(store) -> dict[str, list[str]]:
    with store.Session() as s:
        return {
            t.name: sorted(repr(tuple(row)) for row in s.execute(select(t)))
            for t in Base.metadata.sorted_tables
        }


def _files(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_every_get_route_leaves_store_and_files_unchanged(store, tmp_path):
    api = in_process_api(store, tmp_path)
    done = api.create(batch_lines("done", 5))  # run over, files written by the finalizer
    finish_run(store, done["canvasq"]["run_id"], errored=1)
    assert api.batches.finalize_ended() == 1
    late = api.create(batch_lines("late", 6))  # run over, files not written yet: `finalizing`
    finish_run(store, late["canvasq"]["run_id"])
    running = api.create(batch_lines("running", 4))
    failed = api.create(b'{"custom_id": "x"}\n')
    assert failed["status"] == "failed" and running["status"] == "in_progress"
    done = api.get(f"/v1/batches/{done['id']}").json()
    assert done["status"] == "completed" and done["output_file_id"] and done["error_file_id"]

    batch_ids = [late["id"], done["id"], running["id"], failed["id"]]
    file_ids = [f["id"] for f in api.get("/v1/files").json()["data"]]
    assert {done["output_file_id"], done["error_file_id"]} <= set(file_ids)
    values = {
        "batch_id": batch_ids,
        "file_id": file_ids,
        "custom_id": ["done-1", "nobody"],
        "name": [*ASSETS, "x"],
    }
    routes = [r for r in api.client.app.routes if isinstance(r, APIRoute) and "GET" in r.methods]
    assert len(routes) >= 10

    before_tables, before_files = _tables(store), _files(api.files_dir)
    statuses = {}
    for route in routes:
        params = route.param_convertors
        assert set(params) <= set(values), f"GET {route.path}: teach this test its parameters {set(params)}"
        combos = [{}]
        for name in params:
            combos = [{**c, name: v} for c in combos for v in values[name]]
        for combo in combos:
            res = api.get(route.path.format(**combo))
            assert res.status_code in (200, 404), (route.path, combo, res.status_code, res.text)
            statuses[(route.path, *combo.values())] = res.status_code
    assert len(statuses) > 30 and sum(code == 200 for code in statuses.values()) > 25
    assert statuses[("/v1/dashboard/batches/{batch_id}/trace/{custom_id}", done["id"], "done-1")] == 200
    assert api.get(f"/v1/batches/{late['id']}").json()["status"] == "finalizing"
    assert _tables(store) == before_tables
    assert _files(api.files_dir) == before_files

    # the finalizer writes what the reads left alone
    assert api.batches.finalize_ended() == 1
    b = api.get(f"/v1/batches/{late['id']}").json()
    assert b["status"] == "completed" and b["output_file_id"] and b["error_file_id"] is None
    assert api.batches.finalize_ended() == 0
