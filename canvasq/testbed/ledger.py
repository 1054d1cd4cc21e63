"""The legacy training ledger: every prompt the committed testbed weights were trained on, kept as a
Bloom filter (`legacy_train.bloom`) so that dev and eval never draw one (`tasks.generate`).

The committed weights predate the splits: they were trained on unpartitioned streams
(`tasks.legacy_generate`, listed in `LEGACY_TRAINING`), whose problems may fall in any bucket of
`tasks.split_of`. A Bloom filter has no false negatives, so every legacy training prompt is skipped;
a false positive (~1 %) only skips an innocent candidate. The filter stores a digest of
`LEGACY_TRAINING` and refuses to load against a different list (rebuild it then).

Rebuild / verify in full (2.5 M problems, about 2 minutes on 2 cores; `ledger_build`, which draws the
streams from `tasks`, so that this reader stays below `tasks`):
    python -m canvasq.testbed.ledger_build build
    python -m canvasq.testbed.ledger_build check
"""

from __future__ import annotations

import hashlib
import math
import struct
from pathlib import Path

FILTER_PATH = Path(__file__).with_name("legacy_train.bloom")
_HEADER = struct.Struct("<8sQIQ32s")  # magic, bits m, hashes k, distinct prompts n, sha256 of the list
_MAGIC = b"CQBLOOM1"
_MASK = (1 << 64) - 1
_CHUNK = 5000  # train_data.build_pool's problems per stream


def _pool(seed: int, n_per_task: int) -> tuple[tuple[str, int, int], ...]:
    """The streams `train_data.build_pool(n_per_task, seed)` drew from: 5,000 problems per stream seed
    `seed * 1_000_003 + i`, per task."""
    return tuple(
        (task, seed * 1_000_003 + i, min(_CHUNK, n_per_task - i * _CHUNK))
        for task in ("arith", "code")
        for i in range(math.ceil(n_per_task / _CHUNK))
    )


# (task, legacy stream seed, problems drawn from its start) for every stream a committed weight file
# was trained on (README "How it was trained", BENCHMARKS.md "Testbed training" and PHCD History, the
# train_report_*.json files). Not listed: the D2F round-5 adapter, discarded (d2f_adapter/ last
# changed with round 4, 4e9724f). Round 1 drew arith with an earlier answer wording git does not keep;
# its streams are listed as today's generator draws them, the closest record there is.
LEGACY_TRAINING: tuple[tuple[str, int, int], ...] = (
    *_pool(0, 300_000),  # round 1 base, --seed 0, 300,000 per task (train.py's default)
    *_pool(1, 300_000),  # round 2 base and its D2F adapter
    *_pool(2, 300_000),  # round 3 base: the committed model-*.safetensors
    *_pool(3, 300_000),  # round 4 D2F adapter: the committed d2f_adapter/
    *_pool(5, 20_000),  # phcd repair v1/v2 (phcd_adapter/): --seed 5, 10,000 per task; the default 20,000
    ("arith", 12345, 20_000),  # the tokenizer's corpus (tokenizer.py's defaults): a BPE, no weights,
    ("code", 12345, 20_000),  # but those prompts were seen; excluded all the same
)


def _list_digest(entries) -> bytes:
    return hashlib.sha256(repr(tuple(entries)).encode()).digest()


def _digest(prompt: str) -> bytes:
    return hashlib.blake2b(prompt.encode(), digest_size=16, person=b"canvasq-ledger").digest()


class Bloom:
    """m bits, k probes by double hashing of a prompt's blake2b digest; bit j is bit j % 8 of byte j // 8."""

    def __init__(self, m: int, k: int, n: int, list_digest: bytes, bits: bytes):
        self.m, self.k, self.n, self.list_digest, self.bits = m, k, n, list_digest, bits

    def __contains__(self, prompt: str) -> bool:
        d = _digest(prompt)
        h1, h2 = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1
        bits, m = self.bits, self.m
        for i in range(self.k):
            j = ((h1 + i * h2) & _MASK) % m
            if not bits[j >> 3] >> (j & 7) & 1:
                return False
        return True

    def false_positive_rate(self) -> float:
        """The expected rate for a prompt not in the filter, (1 - e^(-kn/m))^k."""
        return (1 - math.exp(-self.k * self.n / self.m)) ** self.k

    def to_bytes(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.m, self.k, self.n, self.list_digest) + self.bits

    @classmethod
    def from_bytes(cls, data: bytes) -> Bloom:
        magic, m, k, n, list_digest = _HEADER.unpack_from(data)
        bits = data[_HEADER.size :]
        if magic != _MAGIC or len(bits) != (m + 7) // 8:
            raise ValueError("not a canvasq Bloom filter (bad magic or size)")
        return cls(m, k, n, list_digest, bits)


_FILTER: Bloom | None = None


def legacy_filter() -> Bloom:
    """The committed filter, loaded once per process; refuses one built for a different list."""
    global _FILTER
    if _FILTER is None:
        bloom = Bloom.from_bytes(FILTER_PATH.read_bytes())
        if bloom.list_digest != _list_digest(LEGACY_TRAINING):
            raise RuntimeError(
                f"{FILTER_PATH} was built for another LEGACY_TRAINING list: "
                "rebuild it with `python -m canvasq.testbed.ledger_build build`"
            )
        _FILTER = bloom
    return _FILTER


def in_legacy_training(prompt: str) -> bool:
    """True for every prompt the committed weights were trained on (and ~1 % of the others)."""
    return prompt in legacy_filter()
