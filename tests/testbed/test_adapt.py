"""`canvasq adapt` at a tiny size on the CPU (issue 35 item 2): the teacher's verified answers and the
decoders' recorded states make batches whose loss goes down under a few optimiser steps, and the
command writes an adapter that `adapter_path` loads and pipe and Funnel decode with."""

import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.model.loading import DEFAULT_MODEL_DIR as TESTBED_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (TESTBED_DIR / "d2f_adapter").is_dir(), reason="needs the trained testbed (models/testbed)"
    ),
]


@pytest.fixture(scope="module")
def bundle():
    from canvasq.model.loading import load_bundle

    torch.set_num_threads(1)
    return load_bundle(str(TESTBED_DIR))


def test_states_train_only_open_positions_and_the_loss_goes_down(bundle):
    from canvasq.testbed.adapt import AdaptSettings, _student, adapt_loss
    from canvasq.testbed.adapt_data import collate, rollout, teacher_answers

    teachers, tried = teacher_answers(bundle, "arith", 4, 11, 4, lambda _: None)
    assert tried == 4 and teachers, "the testbed's official sampler answers some train problems right"
    for t in teachers:
        assert t.uid.startswith("arith-train-") and t.answer[-1] == bundle.eos_id
    states, _ = rollout(bundle, teachers, ("funnel", {"front": "revise"}), 1.0, 3, 4)
    assert states
    C = bundle.canvas_length
    for s in states:
        assert s.k % C == 0 and s.sc_rows.shape == s.train.shape
        assert bool(s.train.any())  # a revising front is open until it is accepted
    with_sc = [s for s in states if s.sc is not None]
    assert with_sc  # Funnel's top-64 projection, kept as logits with the rest at -inf
    top = with_sc[0]
    assert int(torch.isfinite(top.sc[top.sc_rows][0]).sum()) == 64
    g = torch.Generator().manual_seed(0)
    group = [s for s in states if s.k == states[0].k][:6]
    batch = collate(group, C, 768, bundle.pad_id, 0.0, g)
    assert batch.sc is None or bool(torch.isfinite(batch.sc).all())
    model = _student(bundle, AdaptSettings(out=Path("unused"), init=None))  # a fresh LoRA
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for i in range(6):
        with warnings.catch_warnings():  # the cache goes by the name this transformers takes
            warnings.simplefilter("error" if i == 0 else "default", FutureWarning)
            loss, ce, cal = adapt_loss(model.base_model.model, batch, C, 0.7, 1.0)
        assert ce >= 0 and cal >= 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_adapt_command_writes_an_adapter_the_decoders_load(bundle, tmp_path):
    out = tmp_path / "self"
    args = ["adapt", "--out", str(out), "--task", "arith", "--teacher-n", "4", "--rounds", "1"]
    res = CliRunner().invoke(
        cli, [*args, "--max-steps", "2", "--batch", "4", "--init", "none", "--threads", "1"]
    )
    assert res.exit_code == 0, res.output
    assert (out / "adapter_config.json").is_file() and (out / "adapt_report.json").is_file()
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 1 and "already holds an adapter" in again.output
    own = CliRunner().invoke(cli, ["adapt", "--out", str(TESTBED_DIR / "d2f_adapter")])
    assert own.exit_code == 1 and "own d2f_adapter" in own.output

    from canvasq.decoders.adapters import merged_model
    from canvasq.testbed import tasks

    merged = merged_model(bundle, str(out))
    assert merged is merged_model(bundle, str(out))  # one copy per directory
    name = "model.decoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], bundle.hf_model.state_dict()[name])
    problems = tasks.generate("arith", 2, 5, split="train")
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, "arith"), 64, "arith") for p in problems]
    for decoder in ("pipe", "funnel"):
        over = {"front": "revise", "adapter_path": str(out)}
        results = run_batch(bundle, DecodeBatch(reqs, seed=1), decoder, over)
        assert all(r.error is None and r.token_ids for r in results)


def test_logit_target_distils_the_adapter_free_model_on_the_front(bundle):
    """`target="logits"`: the front canvas's open positions learn the model's own distribution with
    the adapter off. A fresh LoRA is that model, so its front part is zero (and every argmax agrees
    with the teacher's: no calibration term); the model's D2F adapter starts away from it and a few
    steps bring it closer."""
    from canvasq.testbed.adapt import AdaptSettings, _student, adapt_loss
    from canvasq.testbed.adapt_data import collate, rollout, teacher_answers

    teachers, _ = teacher_answers(bundle, "arith", 4, 12, 4, lambda _: None)
    states, _ = rollout(bundle, teachers, ("pipe", {"front": "revise"}), 1.0, 5, 4)
    C = bundle.canvas_length
    one = [s for s in states if s.k == C][:6]  # front-only windows: every trained position distils
    assert one
    batch = collate(one, C, 768, bundle.pad_id, 0.0, torch.Generator().manual_seed(0))
    fresh = _student(bundle, AdaptSettings(out=Path("unused"), init=None))
    loss, kl, cal = adapt_loss(fresh.base_model.model, batch, C, 0.7, 1.0, teacher=fresh.disable_adapter)
    assert abs(kl) < 1e-4 and cal == 0.0
    model = _student(bundle, AdaptSettings(out=Path("unused"), init=TESTBED_DIR / "d2f_adapter"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    kls = []
    for _ in range(5):
        loss, kl, _ = adapt_loss(model.base_model.model, batch, C, 0.7, 0.0, teacher=model.disable_adapter)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kls.append(kl)
    assert kls[0] > 1e-3 and kls[-1] < kls[0]


def test_mixed_target_keeps_the_answer_where_the_teacher_finds_it_plausible(bundle):
    """`target="mixed"`: a front position learns the answer's token when the adapter-free teacher gives
    it at least `answer_floor`, else the teacher's distribution. A floor no probability reaches is the
    logits target, a floor every probability clears the tokens target, and one between mixes them."""
    from canvasq.testbed.adapt import AdaptSettings, _student, adapt_loss
    from canvasq.testbed.adapt_data import collate, rollout, teacher_answers

    teachers, _ = teacher_answers(bundle, "arith", 4, 12, 4, lambda _: None)
    states, _ = rollout(bundle, teachers, ("pipe", {"front": "revise"}), 1.0, 5, 4)
    C = bundle.canvas_length
    batch = collate([s for s in states if s.k == C][:6], C, 768, bundle.pad_id, 0.0, torch.Generator())
    model = _student(bundle, AdaptSettings(out=Path("unused"), init=TESTBED_DIR / "d2f_adapter"))
    net, off = model.base_model.model, model.disable_adapter
    with torch.no_grad():
        tokens = adapt_loss(net, batch, C, 0.7, 0.0)[1]
        logits = adapt_loss(net, batch, C, 0.7, 0.0, teacher=off)[1]
        assert abs(tokens - logits) > 1e-3  # the two targets differ on these states
        assert adapt_loss(net, batch, C, 0.7, 0.0, teacher=off, answer_floor=1e-30)[1] == pytest.approx(
            tokens
        )
        assert adapt_loss(net, batch, C, 0.7, 0.0, teacher=off, answer_floor=1 - 1e-7)[1] == pytest.approx(
            logits
        )
        mixed = adapt_loss(net, batch, C, 0.7, 0.0, teacher=off, answer_floor=0.5)[1]
    assert mixed not in (pytest.approx(tokens), pytest.approx(logits))
