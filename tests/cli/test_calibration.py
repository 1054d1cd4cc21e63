"""Calibrations in SQL per model identity, and `--decoder auto` routing from them (real SQLite and
PostgreSQL, the trained testbed for the sweep and the worker)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from canvasq.core import calibrations as stored
from canvasq.core.queue import ClaimedRequest
from canvasq.decoders import calibration as C
from canvasq.decoders.routing import DEFAULT_ROUTE, Route, route, routing_table
from tests.harness.backends import model_for_tests


def _point(family, decoder, knobs, acc, tok_s, reference=False, task=None, tau=7.0, g_over_tau=5.0, n=10_000):
    """A point that does less work than the references below (τ 7 against 6) unless told, measured on
    enough problems that a point of accuracy is resolved (at 10,000 the 95 % bound costs < 1 point)."""
    return C.Point(
        family=family,
        task=task or {"math": "arith", "code": "code"}[family],
        decoder=decoder,
        knobs=knobs,
        n=n,
        accuracy=acc,
        tok_s=tok_s,
        fwd_per_req=10.0,
        tau=tau,
        g_over_tau=g_over_tau,
        reference=reference,
    )


POINTS = [
    _point("math", "official", {}, 0.80, 300.0, reference=True, tau=6.0),
    _point("math", "official", {"max_denoising_steps": 4}, 0.79, 380.0),  # within 2 points: fastest such
    _point("math", "official", {"max_denoising_steps": 2}, 0.77, 450.0),  # 3 points below: never
    _point("math", "official", {"entropy_bound": 1.0}, 0.80, 340.0, tau=6.0),  # the reference's work: noise
    _point("math", "funnel", {"tau_conf": 0.9, "draft_only": True}, 0.60, 900.0),
    _point("code", "official", {}, 0.99, 400.0, reference=True, tau=6.0),
    _point(
        "code", "official", {"entropy_bound": 4.0}, 1.00, 600.0, tau=6.0, g_over_tau=4.0
    ),  # fewer rows/token
    _point("code", "official", {"confidence_threshold": 0.05}, 1.00, 430.0),  # less work, < 10 % faster
    _point("code", "pipe", {"draft_only": True}, 0.975, 700.0),  # 1.5 points below: within budget
]


def _calibration(path="/models/a", fp="f" * 32, points=POINTS, batch=16):
    return C.Calibration(
        model_path=path,
        fingerprint=fp,
        device="cpu",
        batch_size=batch,
        n=40,
        seeds=(101,),
        max_tokens=160,
        points=tuple(C.frontier_flags(list(points))),
        hardware="test",
        commit="abc",
    )


def test_calibration_stored_and_read_back_per_model_identity(store):
    first = stored.save(store, _calibration())
    stored.save(store, _calibration(path="/models/b"))  # another model: never read for /models/a
    got = stored.load(store, "/models/a", "f" * 32)
    assert got is not None and got.id == first and got.batch_size == 16 and got.seeds == (101,)
    assert sorted((p.family, p.label, p.accuracy, p.tok_s) for p in got.points) == sorted(
        (p.family, p.label, p.accuracy, p.tok_s) for p in POINTS
    )
    assert [p.reference for p in got.points] == [p.reference for p in POINTS]
    # funnel at 60 % is its decoder's only point: on its own frontier; official's 77 % point is too
    flags = {p.label: p.frontier for p in got.points if p.family == "math"}
    assert flags["funnel:draft_only=true,tau_conf=0.9"] and flags["official:max_denoising_steps=2"]
    assert stored.load(store, "/models/a", "0" * 32) is None  # same path, other weights: not calibrated
    newer = stored.save(store, _calibration(points=POINTS[:2]))
    assert stored.load(store, "/models/a", "f" * 32).id == newer  # the newest calibration wins
    assert len(stored.load(store, "/models/a", "f" * 32).points) == 2


def test_model_identity_follows_the_weights(tmp_path):
    src = Path(model_for_tests())
    a = tmp_path / "m"
    a.mkdir()
    shutil.copy(src / "config.json", a / "config.json")
    (a / "model.safetensors").write_bytes(b"x" * 10)
    path, fp = C.model_identity(str(a))
    assert path == str(a.resolve())
    (a / "canvasq_w4").mkdir()
    (a / "canvasq_w4" / "experts-1.safetensors").write_bytes(b"y")  # the W4 pack cache is not identity
    assert C.model_identity(str(a)) == (path, fp)
    (a / "model.safetensors").write_bytes(b"x" * 11)  # retrained weights: a new identity
    assert C.model_identity(str(a))[1] != fp
    assert C.model_identity("random:testbed") == ("random:testbed", "random")


def test_routing_picks_the_fastest_within_budget_from_a_stored_calibration(store):
    stored.save(store, _calibration())
    cal = stored.load(store, "/models/a", "f" * 32)
    assert route("arith", calibration=cal) == Route("official", {"max_denoising_steps": 4}, "calibration")
    assert route("math", calibration=cal, budget=2.0).overrides == {"max_denoising_steps": 4}
    assert route("code", calibration=cal) == Route("pipe", {"draft_only": True}, "calibration")
    # a tighter budget: only settings at least as accurate as official
    assert route("code", calibration=cal, budget=1.0) == Route(
        "official", {"entropy_bound": 4.0}, "calibration"
    )
    assert route("arith", calibration=cal, budget=0.0) == Route("official", {}, "calibration")
    # equal work measured 13 % faster (entropy_bound 1.0, 340 tok/s) and less work measured < 10 % faster
    # (confidence_threshold, 430 against 400) never displace the reference
    assert route("arith", calibration=cal, budget=0.0).overrides == {}
    no_bound = C.Calibration(
        **{
            **cal.__dict__,
            "_by_family": {},
            "points": tuple(p for p in cal.points if p.knobs != {"entropy_bound": 4.0}),
        }
    )
    assert route("code", calibration=no_bound, budget=1.0) == Route("official", {}, "calibration")
    # a wide budget reaches the step decoder
    assert route("arith", calibration=cal, budget=25.0).decoder == "funnel"
    # the settings table still wins; an uncalibrated family goes to official
    assert route("arith", {"math": "pipe"}, cal) == Route("pipe", {}, "settings")
    assert route("poetry", calibration=cal) == DEFAULT_ROUTE
    rows = routing_table({"code": "funnel"}, cal, 2.0)
    assert rows[0] == ("code", "funnel", "CANVASQ_ROUTING")
    assert rows[1][:2] == ("math", "official:max_denoising_steps=4") and "calibration #" in rows[1][2]
    assert rows[-1][:2] == ("(any other)", "official")


def test_routing_needs_the_budget_to_hold_with_confidence_at_the_dev_sets_size():
    """A measured math calibration: official with confidence_threshold 0.05 equal to the reference
    (78 %) on 100 dev problems, 14 % faster with fewer forwards; on 600 fresh problems it lost 2.3
    points. At n = 100 the difference's 95 % bound is -9.6 points: not routed; at n = 10,000, -1.0."""

    def cal(n):
        return _calibration(
            points=[
                _point("math", "official", {}, 0.78, 1191.0, reference=True, tau=6.31, n=n),
                _point("math", "official", {"confidence_threshold": 0.05}, 0.78, 1361.0, tau=6.84, n=n),
            ]
        )

    ref, pick = cal(100).points
    assert -9.7 < C.accuracy_bound(pick, ref) < -9.5
    assert route("math", calibration=cal(100)) == Route("official", {}, "calibration")
    assert route("math", calibration=cal(10_000)) == Route(
        "official", {"confidence_threshold": 0.05}, "calibration"
    )


def test_without_a_calibration_auto_is_official(store):
    assert stored.load_for_model(store, model_for_tests()) is None
    for task in ("arith", "math", "code", None):
        assert route(task, calibration=None) == DEFAULT_ROUTE
    assert routing_table(None, None)[-1] == (
        "(any other)",
        "official",
        "default: no calibration, the accurate sampler",
    )


def test_worker_routes_auto_by_its_models_calibration(tmp_path):
    from canvasq.core.settings import Settings
    from canvasq.core.store import Store
    from canvasq.worker.engine import Engine

    url = f"sqlite:///{tmp_path / 'w.sqlite'}"
    st = Store(url)
    st.upgrade()
    try:
        settings = Settings(database_url=url, model=model_for_tests(), device="cpu", routing_budget=2.0)
        rows = [ClaimedRequest("a", "", "arith", 8, None), ClaimedRequest("c", "", "code", 8, None)]
        plain = Engine(settings=settings, store=st, bundle=object(), worker_id="t:1", queue="q")
        assert [(d, k) for d, k, _ in plain.routed("auto", rows)] == [("official", {})]
        path, fp = C.model_identity(model_for_tests())
        stored.save(st, _calibration(path=path, fp=fp))
        assert plain.calibration is None  # read once per process: a new calibration needs a new worker
        engine = Engine(settings=settings, store=st, bundle=object(), worker_id="t:2", queue="q")
        got = {r[0].custom_id: (d, k) for d, k, r in engine.routed("auto", rows)}
        assert got == {"a": ("official", {"max_denoising_steps": 4}), "c": ("pipe", {"draft_only": True})}
        assert [(d, k) for d, k, _ in engine.routed("official", rows)] == [("official", {})]
    finally:
        st.dispose()


def test_calibrate_sweeps_stores_shows_and_routes(service_env):
    """A real (tiny) sweep on the trained testbed: stored for the model, shown, plotted, and what
    `canvasq config` and auto then route by."""
    from canvasq.cli import cli

    model = model_for_tests()
    env = {"CANVASQ_MODEL": model}
    run = CliRunner().invoke(
        cli,
        [
            "calibrate",
            "--task",
            "arith",
            "--n",
            "2",
            "--decoder",
            "official",
            "--arm",
            "funnel:tau_conf=0.9,draft_only=true",
            "--batch-size",
            "2",
            "--max-tokens",
            "32",
        ],
        env=env,
    )
    assert run.exit_code == 0, run.output
    assert "stored calibration #1" in run.output and "official:max_denoising_steps=3" in run.output
    png = service_env["tmp"] / "f.png"
    shown = CliRunner().invoke(cli, ["calibrate", "--show", "--all", "--plot", str(png)], env=env)
    assert shown.exit_code == 0, shown.output
    assert "(reference)" in shown.output and "funnel:draft_only=true,tau_conf=0.9" in shown.output
    assert png.stat().st_size > 1000
    cfg = CliRunner().invoke(cli, ["config"], env=env)
    assert "math -> " in cfg.output and "calibration #1" in cfg.output
    # a model with other weights has no calibration: one line, exit 1
    other = service_env["tmp"] / "other"
    other.mkdir()
    for f in Path(model).iterdir():
        if f.is_file():
            (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    (other / "config.json").write_text(
        json.dumps({**json.loads((Path(model) / "config.json").read_text()), "_note": "changed"})
    )
    miss = CliRunner().invoke(cli, ["calibrate", "--show", "--model", str(other)], env=env)
    assert miss.exit_code == 1 and miss.output.count("\n") == 1 and "no calibration stored" in miss.output


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--seeds", "x"], "--seeds"),
        (["--arm", "funnel:nope=1"], "unknown FunnelConfig option"),
        (["--arm", "hf"], "decoder must be"),
    ],
)
def test_calibrate_refuses_bad_options_in_one_line(service_env, args, msg):
    from canvasq.cli import cli

    res = CliRunner().invoke(
        cli, ["calibrate", "--task", "arith", *args], env={"CANVASQ_MODEL": model_for_tests()}
    )
    assert res.exit_code == 1 and msg in res.output and res.output.count("\n") == 1, res.output


def test_capped_official_line_at_equal_forwards():
    pts = [
        C.Point("math", "arith", "official", {}, 40, 0.8, 600, 15.0, 6, 5, reference=True),
        C.Point("math", "arith", "official", {"max_denoising_steps": 2}, 40, 0.4, 900, 10.0, 9, 3),
        C.Point(
            "math", "arith", "official", {"confidence_threshold": 0.05}, 40, 0.9, 900, 11.0, 9, 3
        ),  # not a cap
    ]
    cal = _calibration(points=pts)
    assert cal.official_line("math", 12.5) == pytest.approx(0.6)
    assert cal.official_line("math", 20.0) == pytest.approx(0.8)  # past the reference: its accuracy
    assert cal.official_line("math", 9.0) is None  # fewer forwards than the smallest cap: no line
    assert cal.official_line("code", 12.0) is None
