"""A finished row's store record: its traces keep every `ForwardTrace` field, `index` stored as
`forward_index`, and its status and error code follow the result."""

from dataclasses import fields

from canvasq.decoders.types import DecodeResult, ForwardTrace
from canvasq.worker.streams import result_record


def test_traces_keep_every_field_and_the_status_follows_the_result():
    traces = [ForwardTrace(i, 64, 5 + i, 2, "full,draft", 1.25 * i, "decode", 32, i) for i in range(3)]
    res = DecodeResult("r1", [5, 6], "ab", "stop", 7, 3, traces=traces, decoder="official")
    rec = result_record(res, 3.5, "official")
    names = {f.name for f in fields(ForwardTrace)} - {"index"}
    assert [set(t) for t in rec.traces] == [names | {"forward_index"}] * 3
    assert [t["forward_index"] for t in rec.traces] == [0, 1, 2]
    assert rec.traces[2] == {
        "rows": 64,
        "commits": 7,
        "canvases": 2,
        "states": "full,draft",
        "ms": 2.5,
        "kind": "decode",
        "own_rows": 32,
        "own_commits": 2,
        "forward_index": 2,
    }
    assert rec.status == "done" and rec.completion_tokens == 2 and rec.gen_ms == 3.5
    failed = result_record(
        DecodeResult("r2", [], "", "error", 7, 1, error="boom", error_code="x"), 0.0, "official"
    )
    assert failed.status == "errored" and failed.error_code == "x" and failed.text is None
