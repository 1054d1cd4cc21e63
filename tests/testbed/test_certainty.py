"""`canvasq adapt --decoder official` at a tiny size on the CPU (issue 35): official's recorded states
target each canvas's own final tokens and only verified rows are kept, the certainty loss forces
entropy only where the argmax is already right and goes down, and the command writes an adapter that
official decodes with (`adapter_path`)."""

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.model.loading import DEFAULT_MODEL_DIR as TESTBED_DIR
from canvasq.testbed import tasks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TESTBED_DIR / "config.json").is_file(), reason="needs the trained testbed"),
]


@pytest.fixture(scope="module")
def bundle():
    from canvasq.model.loading import load_bundle

    torch.set_num_threads(1)
    return load_bundle(str(TESTBED_DIR))


@pytest.fixture(scope="module")
def problems():
    return tasks.generate("arith", 6, 21, split="train")


def test_states_are_the_verified_rows_steps_with_their_canvas_final_tokens(bundle, problems, monkeypatch):
    from canvasq.testbed import certainty

    C = bundle.canvas_length
    rejected = problems[0].uid
    real = tasks.verify
    monkeypatch.setattr(tasks, "verify", lambda p, text: p.uid != rejected and real(p, text))
    got = certainty.rollout(bundle, problems, {}, 1.0, 7, 6)
    assert got["states"] and got["forwards"] > 0
    # the same decode without recording: the states' contexts and targets are its answers' canvases
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, p.task), 5 * C, p.task) for p in problems]
    results = run_batch(bundle, DecodeBatch(reqs, seed=7 * 104_729), "official")
    answers = {tuple(q.prompt_ids): r for q, r in zip(reqs, results)}
    right = {
        tuple(q.prompt_ids)
        for q, p, r in zip(reqs, problems, results)
        if p.uid != rejected and real(p, r.text)
    }
    assert got["right"] == len(right)
    seen = set()
    for s in got["states"]:
        prompt = next(p for p in answers if tuple(s.ctx[: len(p)].tolist()) == p)
        assert prompt in right, "a rejected row's states were kept"
        r = answers[prompt]
        lead = len(s.ctx) - len(prompt)
        assert lead % C == 0 and s.ctx[len(prompt) :].tolist() == r.token_ids[:lead]
        stop = min(len(r.token_ids), lead + C)
        assert s.target[: stop - lead].tolist() == r.token_ids[lead:stop]
        assert bool(s.train.all()) and s.target.shape == s.tokens.shape == (C,)
        if s.sc is None:
            assert not bool(s.sc_rows.any())  # a canvas's first step: no self-conditioning
        else:
            assert int(torch.isfinite(s.sc[0]).sum()) == 64  # the top-64 it fed
        seen.add((prompt, lead))
    assert len(seen) >= len(right)  # every kept row has states


def test_certainty_term_only_on_right_positions_and_the_loss_goes_down(bundle, problems):
    from canvasq.testbed.adapt import AdaptSettings, _student
    from canvasq.testbed.adapt_data import collate
    from canvasq.testbed.certainty import certainty_loss, rollout

    C = bundle.canvas_length
    states = rollout(bundle, problems, {}, 1.0, 7, 6)["states"][:8]
    batch = collate(states, C, 768, bundle.pad_id, 0.0, torch.Generator().manual_seed(0))
    model = _student(bundle, AdaptSettings(out=Path("unused"), init=None))
    net = model.base_model.model
    with torch.no_grad():
        loss, ce, ent = certainty_loss(net, batch, C, 0.5)
        assert ent > 0 and loss == pytest.approx(ce + 0.5 * ent, rel=1e-5)
        assert certainty_loss(net, batch, C, 0.0)[0] == pytest.approx(ce, rel=1e-5)
        wrong = type(batch)(**{**batch.__dict__, "target": (batch.target + 1) % 768})
        assert certainty_loss(net, wrong, C, 0.5)[2] < ent  # fewer right positions: less forced
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(6):
        loss, _, _ = certainty_loss(net, batch, C, 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_adapt_official_writes_an_adapter_official_decodes_with(bundle, tmp_path, problems):
    out = tmp_path / "certain"
    args = ["adapt", "--decoder", "official", "--out", str(out), "--task", "arith", "--teacher-n", "4"]
    res = CliRunner().invoke(
        cli, [*args, "--rounds", "1", "--max-steps", "2", "--batch", "4", "--threads", "1"]
    )
    assert res.exit_code == 0, res.output
    assert "official:adapter_path" in res.output
    report = (out / "adapt_report.json").read_text()
    assert '"decoder": "official"' in report and '"init": null' in report  # not the D2F adapter
    bad = CliRunner().invoke(cli, [*args, "--certainty-weight", "-1", "--force"])
    assert bad.exit_code == 2 and "--certainty-weight" in bad.output

    from canvasq.decoders.adapters import merged_model

    name = "model.decoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        merged_model(bundle, str(out)).state_dict()[name], bundle.hf_model.state_dict()[name]
    )
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, "arith"), 64, "arith") for p in problems[:2]]
    results = run_batch(bundle, DecodeBatch(reqs, seed=1), "official", {"adapter_path": str(out)})
    assert all(r.error is None and r.token_ids for r in results)
    with pytest.raises(FileNotFoundError, match="adapter_path"):
        run_batch(bundle, DecodeBatch(reqs, seed=1), "official", {"adapter_path": str(tmp_path / "none")})
