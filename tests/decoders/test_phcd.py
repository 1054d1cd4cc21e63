"""PHCD on the trained testbed: it decodes both families, commits only safe prefixes of the task's
size, keeps the future across commits (future repair, not regeneration), rides the future at the
coarse rate, and runs through `canvasq eval` / `canvasq bench`."""

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import TESTBED_DIR, trained_testbed

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.phcd import PhcdDecoder
from canvasq.decoders.phcd_plan import commit_sizes
from canvasq.decoders.registry import make_config
from canvasq.decoders.routing import route

pytestmark = pytest.mark.skipif(
    not trained_testbed(), reason="needs the trained testbed checkpoint (models/testbed)"
)


@pytest.fixture(scope="module")
def bundle():
    from canvasq.model.loading import load_bundle

    return load_bundle(str(TESTBED_DIR))


def _batch(bundle, task, n=4, seed=11, max_tokens=64):
    from canvasq.testbed import tasks

    problems = tasks.generate(task, n, seed)
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems]
    return problems, DecodeBatch(reqs, seed=seed)


def test_phcd_decodes_both_families_and_is_not_the_default_route(bundle):
    from canvasq.testbed import tasks

    for task in ("arith", "code"):
        problems, batch = _batch(bundle, task, n=3, max_tokens=128)
        res = run_batch(bundle, batch, decoder="phcd")
        assert all(r.error is None and r.decoder == "phcd" for r in res)
        assert all(r.token_ids and r.stats["commits"] >= len(r.token_ids) for r in res)
        if task == "arith":  # the trained testbed solves most arith problems under PHCD
            assert sum(tasks.verify(p, r.text) for p, r in zip(problems, res)) >= 2
            again = run_batch(bundle, DecodeBatch(batch.requests[:1], seed=batch.seed), decoder="phcd")
            assert again[0].token_ids == res[0].token_ids  # same seed, same tokens, batched or alone
    assert route("math").decoder == "official" and route("code").decoder == "official"


class _Recording(PhcdDecoder):
    """PHCD with its controller's decisions and each commit's slide recorded."""

    def __init__(self, bundle, config=None):
        super().__init__(bundle, config)
        self.decisions, self.slides = [], []

    def _commit_count(self, s, plan, arg, run, W):
        forced = s.stats["forced_commits"]
        n = super()._commit_count(s, plan, arg, run, W)
        stop = any(t in self.stop_ids for t in arg[:n].tolist())
        self.decisions.append((s.req.task, n, run, s.stats["forced_commits"] > forced, stop, plan.commit_hi))
        return n

    def _commit(self, s, plan, toks):
        before = (plan.tokens.clone(), plan.last.clone(), plan.sc_ids.clone(), plan.start)
        super()._commit(s, plan, toks)
        if not s.done:
            after = (plan.tokens.clone(), plan.last.clone(), plan.sc_ids.clone(), plan.start)
            self.slides.append((int(toks.numel()), before, after))


def test_commits_are_safe_prefixes_of_the_task_size(bundle):
    dec = _Recording(bundle, make_config("phcd"))
    sizes = {task: commit_sizes(dec.config, task, dec.C) for task in ("math", "long", "code", None)}
    assert sizes["math"] == sizes["long"] == (1, 2) and sizes["code"] == (1, 4)  # 4-16, 8-32 of 256
    assert sizes[None] == (4, 16)  # text 32-128 of 256 on a 32-token canvas
    for task in ("arith", "code"):
        dec.decode(_batch(bundle, task, n=2)[1])
    assert dec.decisions and any(n for _, n, *_ in dec.decisions)
    for task, n, run, forced, stop, hi in dec.decisions:
        assert n <= hi or stop  # never more than the task's safe-prefix size (EOS ends it anyway)
        assert n <= run or forced  # beyond the safe run only when the window has stalled
        assert hi == (2 if task == "arith" else 4)


def test_repair_keeps_the_future_across_commits(bundle):
    """After a commit of n tokens the global canvas is the old one shifted by n: its tokens, last
    decisions and self-conditioning kept; only positions new at the far end are drawn. A decoder that
    regenerated the future from noise after each commit fails this."""
    dec = _Recording(bundle, make_config("phcd", {"windows": 3}))
    dec.decode(_batch(bundle, "arith", n=1, max_tokens=96)[1])
    assert len(dec.slides) >= 5
    for n, (tok0, last0, sc0, p0), (tok1, last1, sc1, p1) in dec.slides:
        kept = tok0.numel() - n
        assert p1 == p0 + n and kept > 0
        assert torch.equal(tok1[:kept], tok0[n:])
        assert torch.equal(last1[:kept], last0[n:])
        assert torch.equal(sc1[:kept], sc0[n:])
        assert bool((last1[kept:] == -1).all())  # what entered at the end has no decision yet


def test_the_future_rides_at_the_coarse_rate(bundle):
    _, batch = _batch(bundle, "arith", n=1, max_tokens=96)
    for every in (2, 5):
        r = run_batch(bundle, batch, decoder="phcd", overrides={"coarse_every": every})[0]
        decodes = [t for t in r.traces if t.kind == "decode"]
        coarse = [i for i, t in enumerate(decodes) if "coarse" in t.states]
        assert coarse == [i for i in range(len(decodes)) if i % every == 0 and decodes[i].own_rows > 32 + 2]
        assert all(t.own_rows <= 32 + 2 for i, t in enumerate(decodes) if i not in coarse)  # window + pending
    alone = run_batch(bundle, batch, decoder="phcd", overrides={"windows": 1})[0]
    assert all("coarse" not in t.states for t in alone.traces)


def test_latency_marks(bundle):
    _, batch = _batch(bundle, "arith", n=2, max_tokens=96)
    for name in ("official", "phcd", "pipe"):
        for r in run_batch(bundle, batch, decoder=name):
            first, window = r.stats["first_token_pass"], r.stats["first_window_pass"]
            assert 1 <= first <= window <= r.forwards, name
            if len(r.token_ids) > 32:  # the first canvas streams before the answer ends
                assert window < r.forwards, name


def test_long_variant_spans_six_canvases(bundle):
    from canvasq.testbed import tasks

    problems = tasks.generate("long", 60, 1)
    for p in problems:
        assert len(bundle.tokenizer.encode(p.answer, add_special_tokens=False)) + 1 >= 6 * 32
        assert tasks.verify(p, p.answer) and not tasks.verify(
            p, p.answer.replace(f"#### {p.target}", "#### -1")
        )
    assert tasks.ANSWER_CANVASES["long"] * 32 >= max(
        len(bundle.tokenizer.encode(p.answer, add_special_tokens=False)) + 1 for p in problems
    )


def test_eval_and_bench_cli_with_phcd(tmp_path):
    from canvasq.cli import cli

    res = CliRunner().invoke(
        cli,
        ["eval", "--task", "arith", "--n", "2", "--seed", "3", "--decoder", "phcd", "--batch", "2", "--json"],
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output.strip().splitlines()[-1])
    assert d["decoder"] == "phcd" and d["n"] == 2 and d["forwards"] > 0 and d["tokens"] > 0
    res = CliRunner().invoke(
        cli,
        [
            "bench",
            "--task",
            "arith",
            "--n",
            "2",
            "--seeds",
            "1",
            "--batch-size",
            "2",
            "--max-tokens",
            "64",
            "--arm",
            "official",
            "--arm",
            "phcd",
            "--out",
            str(tmp_path),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    rows = {r["arm"]: r for r in json.loads(res.output.strip().splitlines()[-1])["arms"]}
    assert set(rows) == {"official", "phcd"}
    for r in rows.values():
        assert r["n"] == 2 and r["gflop_per_tok_26b"] > 0 and 0 < r["ttft_ms"] <= r["ttfw_ms"]
    assert "| phcd |" in (tmp_path / "bench.md").read_text()


def test_canvasq_run_with_phcd(tmp_path, monkeypatch):
    """The product path: `canvasq run --decoder phcd` (embedded SQLite, the worker's decode stream)
    writes every row, each under the phcd decoder."""
    from canvasq.cli import cli
    from canvasq.core.settings import get_settings

    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "prompt": f"What is {i} plus {i + 3}?",
                    "task": "math",
                    "max_tokens": 16,
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    monkeypatch.setenv("CANVASQ_DATABASE_URL", f"sqlite:///{tmp_path / 'cq.sqlite'}")
    monkeypatch.setenv("CANVASQ_MODEL", str(TESTBED_DIR))
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(
            cli, ["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--decoder", "phcd"]
        )
    finally:
        get_settings.cache_clear()
    assert res.exit_code == 0, res.output
    assert "phcd" in res.output
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2"]
    assert all(x["response"]["status_code"] == 200 for x in lines)


@pytest.mark.skipif(
    not (TESTBED_DIR / "phcd_adapter").is_dir(),
    reason="needs the repair adapter (models/testbed/phcd_adapter)",
)
def test_repair_adapter_knob_loads_and_decodes_both_families(bundle):
    """`phcd:adapter=repair` merges models/testbed/phcd_adapter over the D2F model (a third copy,
    cached on the bundle) and decodes both families; unknown adapter values are refused."""
    dec = PhcdDecoder(bundle, make_config("phcd", {"adapter": "repair"}))
    assert dec.model is bundle.phcd_repair_model() and dec.model is not bundle.d2f_model()
    weights = [  # encoder and decoder share this tensor: parameters lists it once, by one of the names
        next(w for n, w in m.named_parameters() if n.endswith("layers.0.self_attn.q_proj.weight"))
        for m in (bundle.d2f_model(), dec.model)
    ]
    assert not torch.equal(*weights)  # the repair LoRA moved the decoder's weights
    for task in ("arith", "code"):
        _, batch = _batch(bundle, task, n=2, max_tokens=48)
        res = run_batch(bundle, batch, decoder="phcd", overrides={"adapter": "repair"})
        assert all(r.error is None and r.token_ids and r.stats["commits"] >= len(r.token_ids) for r in res)
    with pytest.raises(ValueError, match="adapter"):
        make_config("phcd", {"adapter": "nope"})
