"""The Batch API's answers are typed (`canvasq/serve/objects.py`, each route's `response_model`) with
the fields OpenAI's client reads: every field of `openai.types.Batch`, `FileObject` and `FileDeleted`
(and their nested objects) is declared, and what the routes answer validates as the client's own
types, in every batch state. The full flow through the stock client is tests/serve/test_batch_api.py."""

from __future__ import annotations

import openai.types as oa
from fastapi.routing import APIRoute
from openai.pagination import SyncCursorPage
from openai.types.batch import Errors
from openai.types.batch_usage import InputTokensDetails, OutputTokensDetails

from canvasq.serve import objects
from tests.harness.server import batch_lines
from tests.serve.inprocess import finish_run, in_process_api

PAIRS = [
    (objects.Batch, oa.Batch),
    (objects.FileObject, oa.FileObject),
    (objects.FileDeleted, oa.FileDeleted),
    (objects.BatchRequestCounts, oa.BatchRequestCounts),
    (objects.BatchUsage, oa.BatchUsage),
    (objects.BatchError, oa.BatchError),
    (objects.BatchErrors, Errors),
    (objects.InputTokensDetails, InputTokensDetails),
    (objects.OutputTokensDetails, OutputTokensDetails),
]


def test_every_field_the_client_reads_is_declared():
    for ours, theirs in PAIRS:
        missing = set(theirs.model_fields) - set(ours.model_fields)
        assert not missing, f"{ours.__name__} lacks {missing}"
        for name, field in theirs.model_fields.items():  # a field the client requires is always answered
            assert (
                not field.is_required()
                or ours.model_fields[name].is_required()
                or ours.model_fields[name].default is not None
            ), (ours.__name__, name)
    assert set(objects.BatchStatus.__args__) == set(oa.Batch.model_fields["status"].annotation.__args__)
    assert set(objects.Page.model_fields) >= set(SyncCursorPage.model_fields)


def test_routes_declare_their_objects_and_answer_the_clients_types(store, tmp_path):
    api = in_process_api(store, tmp_path)
    routes = {(m, r.path): r for r in api.client.app.routes if isinstance(r, APIRoute) for m in r.methods}
    declared = {
        ("POST", "/v1/files"): objects.FileObject,
        ("GET", "/v1/files"): objects.Page[objects.FileObject],
        ("GET", "/v1/files/{file_id}"): objects.FileObject,
        ("DELETE", "/v1/files/{file_id}"): objects.FileDeleted,
        ("POST", "/v1/batches"): objects.Batch,
        ("GET", "/v1/batches"): objects.Page[objects.Batch],
        ("GET", "/v1/batches/{batch_id}"): objects.Batch,
        ("POST", "/v1/batches/{batch_id}/cancel"): objects.Batch,
    }
    for key, model in declared.items():
        assert routes[key].response_model is model, key

    done = api.create(batch_lines("done", 4))
    finish_run(store, done["canvasq"]["run_id"], errored=1)
    api.batches.finalize_ended()
    running = api.create(batch_lines("run", 3))
    failed = api.create(b'{"custom_id": "x"}\n')
    cancelled = api.client.post(f"/v1/batches/{running['id']}/cancel", headers=api.headers).json()
    batches = api.get("/v1/batches").json()
    assert set(batches) == set(objects.Page.model_fields) and not batches["has_more"]
    assert [b["id"] for b in batches["data"]] == [failed["id"], running["id"], done["id"]]
    by_status = {}
    for obj in batches["data"]:
        b = oa.Batch.model_validate(obj)
        assert set(obj) == set(objects.Batch.model_fields)  # every field answered, null or not
        by_status[b.status] = b
    assert set(by_status) == {"failed", "cancelled", "completed"} and cancelled["status"] == "cancelled"
    c = by_status["completed"]
    assert (c.request_counts.total, c.request_counts.completed, c.request_counts.failed) == (4, 3, 1)
    assert c.usage.output_tokens == 3 and c.usage.input_tokens_details.cached_tokens == 0 and c.completed_at
    assert c.model_extra["canvasq"]["progress"]["completion_tokens"] == 3
    f = by_status["failed"]
    assert (
        f.errors.object == "list"
        and f.errors.data[0].line == 1
        and f.errors.data[0].code == "invalid_request"
    )
    assert f.usage is None and f.model_extra["canvasq"] is None

    files = api.get("/v1/files").json()
    assert {oa.FileObject.model_validate(x).purpose for x in files["data"]} == {"batch", "batch_output"}
    assert files["first_id"] == files["data"][0]["id"] and files["last_id"] == files["data"][-1]["id"]
    one = oa.FileObject.model_validate(api.get(f"/v1/files/{c.output_file_id}").json())
    assert (one.object, one.status, one.filename) == ("file", "processed", f"{c.id}_output.jsonl")
    gone = api.client.delete(f"/v1/files/{c.output_file_id}", headers=api.headers).json()
    assert oa.FileDeleted.model_validate(gone).deleted and gone == {
        "id": c.output_file_id,
        "object": "file",
        "deleted": True,
    }
