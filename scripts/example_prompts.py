"""Writes `examples/prompts.jsonl`, the README's example: 12 arith and 12 code problems of the testbed's
eval split (`tasks.generate(task, 12, seed=2026)`), so the example never shows the model a problem it
was trained on. Lines alternate math / code; odd-numbered ones are the simple form with a `task`,
even-numbered ones standard OpenAI batch lines without one (canvasq infers it); `max_tokens` 160 / 64
as `canvasq eval` uses.

    python scripts/example_prompts.py            # rewrite examples/prompts.jsonl
    python scripts/example_prompts.py --check    # exit 1 if the file differs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from canvasq.testbed import tasks

PATH = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
SEED, N = 2026, 12
MAX_TOKENS = {"math": 160, "code": 64}


def lines() -> list[str]:
    problems = {"math": tasks.generate("arith", N, SEED), "code": tasks.generate("code", N, SEED)}
    out = []
    for i in range(N):
        for kind in ("math", "code"):
            cid, prompt = f"{kind}-{i + 1:02d}", problems[kind][i].prompt
            if i % 2 == 0:
                row = {"custom_id": cid, "prompt": prompt, "task": kind, "max_tokens": MAX_TOKENS[kind]}
            else:
                row = {
                    "custom_id": cid,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "testbed",
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": MAX_TOKENS[kind],
                    },
                }
            out.append(json.dumps(row))
    return out


def main(argv: list[str]) -> int:
    text = "\n".join(lines()) + "\n"
    if "--check" in argv:
        return 0 if PATH.read_text() == text else 1
    PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
