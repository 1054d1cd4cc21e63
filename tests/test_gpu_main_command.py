"""The README's main command on a GPU machine, as a new user runs it (H200 machine:
`python3 -m pytest -m gpu tests/test_gpu_main_command.py -q`).

`canvasq run examples/prompts.jsonl -o results.jsonl` in a subprocess with the default settings
(CANVASQ_DEVICE, CANVASQ_EXPERTS and CANVASQ_CUDA_GRAPHS unset), against (a) the committed testbed and
(b) a real-width checkpoint: the 26B-A4B shape with 6 layers, random bf16 weights, written with
`save_pretrained` beside the testbed's tokenizer (its ids fit the real vocabulary; same pad/eos/bos).
Each run must finish every row on a CUDA device with W4 experts and replayed CUDA graphs, which the
run reports in its `engine:` line on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "models" / "testbed"
PROMPTS = REPO / "examples" / "prompts.jsonl"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _main_command(workdir: Path, model: Path, prompts: Path, timeout_s: int) -> dict:
    """Run `canvasq run PROMPTS -o results.jsonl` in `workdir`; return the engine line's dict."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANVASQ_")}
    env.update(CANVASQ_MODEL=str(model), CANVASQ_DATABASE_URL=f"sqlite:///{workdir / 'canvasq.sqlite'}")
    cmd = [sys.executable, "-m", "canvasq.cli", "run", str(prompts), "-o", "results.jsonl"]
    proc = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    n = sum(1 for line in prompts.read_text().splitlines() if line.strip())
    assert f"wrote {n} results and 0 errors" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert len((workdir / "results.jsonl").read_text().splitlines()) == n
    engine = [line for line in proc.stderr.splitlines() if line.startswith("engine: ")]
    assert engine, proc.stderr[-3000:]
    return json.loads(engine[-1].removeprefix("engine: "))


def _assert_fast_path(engine: dict) -> None:
    assert engine["device"].startswith("cuda:"), engine
    assert engine["experts"] == "w4" and engine["w4_modules"] > 0, engine
    assert engine["graphs"]["replayed"] > 0, engine


def test_main_command_on_the_testbed(tmp_path):
    engine = _main_command(tmp_path, TESTBED, PROMPTS, timeout_s=900)
    _assert_fast_path(engine)


@pytest.fixture(scope="module")
def real_width_checkpoint(tmp_path_factory):
    """26B-A4B widths, 6 layers (5 sliding + 1 full), random bf16 weights, saved like a real checkpoint."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvasq.model.shapes import REAL_26B_A4B, build_config

    out = tmp_path_factory.mktemp("real6")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DiffusionGemmaForBlockDiffusion._from_config(
            build_config(REAL_26B_A4B.replace(num_hidden_layers=6)), dtype=torch.bfloat16
        )
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TESTBED / name, out / name)
    return out


def test_main_command_on_a_real_width_checkpoint(real_width_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # the README's prompts, fewer tokens (random weights never stop)
    lines = []
    for raw in PROMPTS.read_text().splitlines()[:8]:
        line = json.loads(raw)
        line.get("body", line)["max_tokens"] = 16
        lines.append(json.dumps(line))
    prompts.write_text("\n".join(lines) + "\n")
    engine = _main_command(tmp_path, real_width_checkpoint, prompts, timeout_s=1200)
    _assert_fast_path(engine)
    assert engine["w4_modules"] == 12, engine  # 6 encoder + 6 decoder experts modules, packed
    cache = list((real_width_checkpoint / "canvasq_w4").glob("experts-*-bfloat16.safetensors"))
    assert len(cache) == 1, cache  # packed at the first start, beside the checkpoint
    # the second start reads the cache (same file, not rewritten)
    stamp = cache[0].stat().st_mtime_ns
    (tmp_path / "again").mkdir()
    _assert_fast_path(_main_command(tmp_path / "again", real_width_checkpoint, prompts, timeout_s=1200))
    assert cache[0].stat().st_mtime_ns == stamp
