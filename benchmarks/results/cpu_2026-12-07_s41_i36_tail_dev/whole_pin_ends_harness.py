"""The experiment before 15de378: a canvas whose every position the settle rules pin stops in that
step (ORed into the sampler's stop), then `benchmarks/structured_output.py` with the given arguments.

    python3 whole_pin_ends_harness.py on|off <structured_output.py arguments>   # from the repository root
"""

import runpy
import sys

import torch

import canvasq.decoders.constraint_rules as cr
import canvasq.decoders.official as off

ON = sys.argv[1] == "on"
STASH: dict = {}
_settle = cr.settle_rule
_stopped = off.OfficialDecoder._stopped


def settle_rule(st, rows, toks, ends, capped, settle, positions, opens):
    pins = _settle(st, rows, toks, ends, capped, settle, positions, opens)
    STASH["b"], STASH["whole"] = rows.b.long(), (pins >= 0).all(dim=-1)
    return pins


def stopped(self, seqs, idx, argmax, entropy):
    out = _stopped(self, seqs, idx, argmax, entropy)
    if ON and "b" in STASH:
        extra = torch.zeros_like(out)
        extra[STASH["b"]] = STASH["whole"]
        out = out | extra
    STASH.clear()
    return out


cr.settle_rule = settle_rule
off.OfficialDecoder._stopped = stopped
sys.argv = ["structured_output.py", *sys.argv[2:]]
runpy.run_path("benchmarks/structured_output.py", run_name="__main__")
