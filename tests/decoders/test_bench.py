"""`canvasq bench` mechanics (ABBA order, report files, last-line JSON) and the replay benchmark."""

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import tiny_bundle

from canvasq.decoders.bench import markdown, parse_arm, run_bench, save, summary_json
from canvasq.testbed import tasks

ROOT = Path(__file__).resolve().parents[2]


def test_parse_arm():
    a = parse_arm("pipe:tau_conf=0.85,tau_eos=0.5,renoise=mix,sc_topk=null")
    assert a.decoder == "pipe" and a.overrides == {
        "tau_conf": 0.85,
        "tau_eos": 0.5,
        "renoise": "mix",
        "sc_topk": None,
    }
    assert parse_arm("official").overrides == {}


@pytest.mark.skipif(
    not (ROOT / "models/testbed/tokenizer.json").exists(), reason="needs the testbed tokenizer"
)
def test_run_bench_abba_and_reports(tmp_path):
    from canvasq.model.loading import load_bundle

    bundle = load_bundle("random:testbed")
    arms = [parse_arm("official:max_denoising_steps=2"), parse_arm("funnel:tau_conf=0.05")]
    rep = run_bench(bundle, arms, ["arith"], n=2, seeds=[1, 2], batch_size=2, max_tokens=32, suite=tasks)
    assert [b["order"] for b in rep["order"]] == [[a.label for a in arms], [a.label for a in reversed(arms)]]
    assert [r["n"] for r in rep["arms"]] == [4, 4]
    for r in rep["arms"]:
        assert r["fwd_per_req"] >= 2 and r["passes"] >= 1 and 0 <= r["acc"] <= 1
    md, png = save(rep, tmp_path)
    assert "| official:max_denoising_steps=2 |" in md.read_text() and png.stat().st_size > 0
    assert json.loads(summary_json(rep))["n"] == 2
    assert "× fewer" in markdown(rep)
    assert rep["commit"] and rep["hardware"] and f"commit {rep['commit']}" in markdown(rep)


@pytest.mark.skipif(
    not (ROOT / "models/testbed/tokenizer.json").exists(), reason="needs the testbed tokenizer"
)
def test_bench_draws_eval_problems_and_calibration_dev_problems():
    """A bench reports accuracy: the eval split. A calibration tunes: the dev split (never eval)."""
    from canvasq.decoders.calibration import run_sweep
    from canvasq.model.loading import load_bundle

    bundle = load_bundle("random:testbed")
    arms = [parse_arm("official:max_denoising_steps=2")]
    rep = run_bench(bundle, arms, ["arith"], n=1, seeds=[1], batch_size=1, max_tokens=32, suite=tasks)
    assert rep["split"] == "eval"
    _, rep = run_sweep(bundle, arms, ["arith"], n=1, seeds=[1], batch_size=1, max_tokens=32, suite=tasks)
    assert rep["split"] == "dev"


def test_record_and_replay_schedule():
    spec = importlib.util.spec_from_file_location("bench_decoders", ROOT / "benchmarks" / "decoders.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from canvasq.decoders import DecodeRequest
    from canvasq.decoders.runtimes import runtime_for

    b = tiny_bundle(peak=3.0)
    reqs = [DecodeRequest(f"r{i}", [2, 5 + i, 6, 7, 4], 16) for i in range(3)]
    for arm in ("funnel", "official:max_denoising_steps=2"):
        sched = mod.record(b, arm, reqs, batch=2, seed=0)
        assert sched["tokens"] > 0 and sched["passes"]
        assert {p["kind"] for p in sched["passes"]} == {"decode", "encode"}
        res = mod.replay(runtime_for(b.hf_model, "bf16"), sched, canvas_length=16, device="cpu", reps=1)
        assert res["label"] == "replayed" and res["scale"] == 2.0 and res["tok_s_replayed"] > 0
        # the same passes through DecodeGraphs (prepared-forward path on CPU): same rows, some buckets
        g = mod.replay(
            runtime_for(b.hf_model, "bf16"), sched, canvas_length=16, device="cpu", reps=1, graphs=True
        )
        assert g["rows_per_pass"] == res["rows_per_pass"] and g["forward"].startswith("CUDA graphs (")
        assert int(g["forward"].split("(")[1].split()[0]) >= 1
