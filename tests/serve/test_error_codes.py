"""A Batch's `errors.data[].code` is carried by the error from where it is found
(`schemas.LineErrorCode` on each `LineError`), never recovered from its message: a message that
quotes the user's text (an unknown task named "duplicate custom_id") keeps its own code."""

from __future__ import annotations

import json

from canvasq.core.schemas import Limits, LineErrorCode, validate_file
from canvasq.serve.batches import report_errors


def test_each_error_carries_its_code(tmp_path):
    ok = {"custom_id": "a", "prompt": "What is 2 plus 2?"}
    lines = [
        json.dumps(ok),
        "{not json",
        "[1, 2]",
        json.dumps(ok),
        json.dumps({"custom_id": "b", "prompt": "x", "task": "duplicate custom_id"}),
        json.dumps({"custom_id": "c", "prompt": "x", "task": "malformed JSON"}),
        json.dumps({"custom_id": "d", "prompt": ""}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    codes = {e["line"]: e["code"] for e in report_errors(validate_file(src, Limits(max_errors=3)))}
    assert codes == {
        2: "invalid_json_line",
        3: "invalid_json_line",
        4: "duplicate_custom_id",
        None: "too_many_errors",
    }
    codes = {e["line"]: e["code"] for e in report_errors(validate_file(src, Limits()))}
    assert codes == {
        2: "invalid_json_line",
        3: "invalid_json_line",
        4: "duplicate_custom_id",
        5: "invalid_request",
        6: "invalid_request",
        7: "invalid_request",
    }

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert [e.code for e in validate_file(empty, Limits()).errors] == [LineErrorCode.empty_file]
    assert [e.code for e in validate_file(tmp_path, Limits()).errors] == [LineErrorCode.invalid_file]
