"""`GET /v1/batches` answers a page in a fixed number of SQL statements, however many batches the page
holds (it was 1 + 7 per batch): counted with a SQLAlchemy `before_cursor_execute` listener on the
store's engine, over pages of 1 and of 12 batches in every state."""

from __future__ import annotations

from contextlib import contextmanager

from sqlalchemy import event

from tests.harness.server import batch_lines
from tests.serve.inprocess import finish_run, in_process_api


@contextmanager
def counting(engine):
    statements: list[str] = []

    def count(_conn, _cursor, statement, *_args):
        if not statement.startswith("BEGIN"):  # SQLite's per-session BEGIN IMMEDIATE is no query
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_batch_list_is_a_fixed_number_of_statements(store, tmp_path):
    api = in_process_api(store, tmp_path)
    made = []
    for i in range(12):
        b = api.create(batch_lines(f"b{i}", 3) if i % 4 else b'{"custom_id": "x"}\n')  # every 4th fails
        if i % 4 and i % 3 == 1:
            finish_run(store, b["canvasq"]["run_id"], errored=1)
        made.append(b["id"])
    api.batches.finalize_ended()

    def page(limit: int, **params) -> tuple[list[dict], int]:
        with counting(store.engine) as statements:
            res = api.get("/v1/batches", limit=limit, **params)
        assert res.status_code == 200, res.text
        return res.json()["data"], len(statements)

    one, n_one = page(1)
    twelve, n_twelve = page(12)
    after, n_after = page(12, after=made[7])
    assert [b["id"] for b in one] == made[-1:] and [b["id"] for b in twelve] == made[::-1]
    assert [b["id"] for b in after] == made[6::-1]
    assert n_twelve == n_one and n_after == n_one + 1  # + the `after` cursor's lookup
    assert n_one == 6  # the key, the page, four queries over the page's runs
    # each listed object is the one a GET of the batch answers
    assert twelve == [api.get(f"/v1/batches/{b['id']}").json() for b in twelve]
    assert {b["status"] for b in twelve} == {"failed", "in_progress", "completed"}
