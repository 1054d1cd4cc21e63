"""Decoders on recorded schedules (label: "replayed"): random weights at the real shape never
converge, so a replayed request stops each official canvas after its recorded denoising steps and
ends after its recorded canvases, or commits phcd's recorded sizes on each forward, while the loop
runs its real forwards and sampler work. Used by `official_service.py`, `decoders.py replay-live`
and the fleet script's workers (CANVASQ_TEST_REPLAY, `canvasq.worker.faults.install_replay`).

    from benchmarks import replay
    replay.OFFICIAL[custom_id] = [steps of canvas 1, canvas 2, ...]
    replay.install()            # `official` and `phcd` are served by the replaying subclasses

Requests not in the tables decode as usual.
"""

from __future__ import annotations

import torch

from canvasq.decoders import registry
from canvasq.decoders.official import OfficialDecoder
from canvasq.decoders.phcd import PhcdDecoder
from canvasq.decoders.types import FinishReason

OFFICIAL: dict[str, list[int]] = {}  # custom_id -> denoising steps per canvas, recorded on the testbed
PHCD: dict[str, list[int]] = {}  # custom_id -> commit sizes, one per forward (0 = no commit), scaled


class ReplayedOfficial(OfficialDecoder):
    def _stopped(self, seqs, idx, argmax, entropy):
        stopped = super()._stopped(seqs, idx, argmax, entropy)
        plans = [OFFICIAL.get(s.req.custom_id) for s in seqs]
        if all(p is None for p in plans):
            return stopped
        taken = self.sampler.steps - self.slots.left[idx] + 1  # this canvas's steps, this one included
        want = [p[s.spawned - 1] if p is not None else 0 for p, s in zip(plans, seqs)]
        listed = torch.tensor([p is not None for p in plans], device=stopped.device)
        # the recorded schedule decides, not the stopper
        return torch.where(listed, taken >= torch.tensor(want, device=stopped.device), stopped)

    def answer_ends(self, s, toks):
        plan = OFFICIAL.get(s.req.custom_id)
        if plan is None:
            return super().answer_ends(s, toks)
        return FinishReason.length if s.spawned >= len(plan) else None


class ReplayedPhcd(PhcdDecoder):
    def _commit_count(self, s, plan, arg: torch.Tensor, run: int, W: int) -> int:
        replayed = PHCD.get(s.req.custom_id)
        if replayed is None:
            return super()._commit_count(s, plan, arg, run, W)
        i = plan.forwards - 1
        return min(replayed[i] if i < len(replayed) else W, W)

    def _ends_at_stop(self, s, out):  # a replayed request never ends on a sampled EOS
        return s.req.custom_id not in PHCD and super()._ends_at_stop(s, out)


def install() -> None:
    registry.substitute("official", ReplayedOfficial)
    registry.substitute("phcd", ReplayedPhcd)


def uninstall() -> None:
    registry.substitute("official", None)
    registry.substitute("phcd", None)
