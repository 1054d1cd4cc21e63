"""The replaying decoders of `benchmarks/replay.py` (what the "replayed" figures run): a listed request
follows its recorded schedule exactly, and the others decode as usual."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from canvasq.decoders import DecodeBatch, DecodeRequest, registry, run_batch
from canvasq.model.loading import load_bundle
from canvasq.testbed import tasks

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import replay


@pytest.fixture(scope="module")
def testbed():
    return load_bundle()


@pytest.fixture
def installed():
    replay.install()
    try:
        yield replay
    finally:
        replay.uninstall()
        replay.OFFICIAL.clear()


def _steps_per_canvas(result) -> list[int]:
    steps, cur = [], 0
    for t in result.traces:
        if t.kind == "decode":
            cur += 1
        elif cur:
            steps.append(cur)
            cur = 0
    return [*steps, cur] if cur else steps


def test_official_replays_its_recorded_steps_and_canvases(testbed, installed):
    probs = tasks.generate("arith", 2, 3)
    reqs = [
        DecodeRequest(f"r{i}", testbed.encode_prompt(p.prompt, p.task), 96, p.task)
        for i, p in enumerate(probs)
    ]
    installed.OFFICIAL["r0"] = [2, 5]  # two canvases: stop after 2, then 5 steps, whatever the stopper says
    assert registry.decoder_class("official") is replay.ReplayedOfficial
    got = run_batch(testbed, DecodeBatch(reqs, seed=1), "official", overrides={"cuda_graphs": "off"})
    assert _steps_per_canvas(got[0]) == [2, 5]
    assert len(got[0].token_ids) <= 2 * testbed.canvas_length and got[0].finish_reason in ("length", "stop")
    installed.uninstall()
    plain = run_batch(testbed, DecodeBatch(reqs, seed=1), "official", overrides={"cuda_graphs": "off"})
    assert got[1].token_ids == plain[1].token_ids  # a request not listed decodes as usual
    assert registry.decoder_class("official").__name__ == "OfficialDecoder"
