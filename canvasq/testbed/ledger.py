"""The legacy training ledger: every prompt the committed testbed weights were trained on, kept as a
Bloom filter (`legacy_train.bloom`) so that dev and eval never draw one (`tasks.generate`).

The committed weights predate the splits: they were trained on unpartitioned streams
(`tasks.legacy_generate`, listed in `LEGACY_TRAINING`), whose problems may fall in any bucket of
`tasks.split_of`. A Bloom filter has no false negatives, so every legacy training prompt is skipped;
a false positive (~1 %) only skips an innocent candidate. The filter stores a digest of
`LEGACY_TRAINING` and refuses to load against a different list (rebuild it then).

Rebuild / verify in full (2.5 M problems, about 2 minutes on 2 cores):
    python -m canvasq.testbed.ledger build
    python -m canvasq.testbed.ledger check
"""

from __future__ import annotations

import argparse
import hashlib
import math
import struct
import sys
import time
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


def _stream_digests(entry: tuple[str, int, int]) -> bytes:
    """One stream's prompts as concatenated 16-byte digests (what crosses the process boundary)."""
    from canvasq.testbed import tasks

    task, seed, n = entry
    return b"".join(_digest(p.prompt) for p in tasks.legacy_generate(task, n, seed))


def legacy_training_prompts(entries=LEGACY_TRAINING):
    """Every legacy training prompt, in `entries`' order (duplicates included)."""
    from canvasq.testbed import tasks

    for task, seed, n in entries:
        for p in tasks.legacy_generate(task, n, seed):
            yield p.prompt


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


def _probes(digests, m: int, k: int):
    """The k bit indices of each digest ([k, N] uint64), as `Bloom.__contains__` computes them."""
    import numpy as np

    d = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
    h1, h2 = d[:, 0], d[:, 1] | np.uint64(1)
    with np.errstate(over="ignore"):
        return np.stack([(h1 + np.uint64(i) * h2) % np.uint64(m) for i in range(k)])


def _all_digests(workers: int, entries=LEGACY_TRAINING) -> list[bytes]:
    from multiprocessing import Pool

    # Code streams first: they cost ~8x arith's per problem, so the pool ends evenly.
    jobs = sorted(entries, key=lambda e: e[0] != "code")
    with Pool(workers) as pool:
        return pool.map(_stream_digests, jobs, chunksize=1)


def build(
    path: Path = FILTER_PATH, workers: int = 2, fp_rate: float = 0.01, entries=LEGACY_TRAINING
) -> Bloom:
    """Draw every legacy training stream, size the filter for `fp_rate` at its distinct prompts, write it."""
    import numpy as np

    raw = np.frombuffer(b"".join(_all_digests(workers, entries)), dtype="V16")
    uniq = np.unique(raw).tobytes()
    n = len(uniq) // 16
    m = math.ceil(-n * math.log(fp_rate) / math.log(2) ** 2 / 8) * 8
    k = max(1, round(m / n * math.log(2)))
    bits = np.zeros(m, dtype=bool)
    bits[_probes(uniq, m, k).ravel()] = True
    bloom = Bloom(m, k, n, _list_digest(entries), np.packbits(bits, bitorder="little").tobytes())
    path.write_bytes(bloom.to_bytes())
    return bloom


def check(
    path: Path = FILTER_PATH, workers: int = 2, n_probes: int = 1_000_000, entries=LEGACY_TRAINING
) -> dict:
    """Every legacy training prompt must be in the filter (all of them drawn again); the measured false-
    positive rate on `n_probes` strings that are no prompt at all, against the expected one."""
    import numpy as np

    bloom = Bloom.from_bytes(path.read_bytes())
    digests = b"".join(_all_digests(workers, entries))
    bits = np.unpackbits(np.frombuffer(bloom.bits, dtype=np.uint8), bitorder="little").astype(bool)
    missing = int((~bits[_probes(digests, bloom.m, bloom.k)].all(axis=0)).sum())
    probes = b"".join(_digest(f"not a prompt {i}") for i in range(n_probes))
    fp = float(bits[_probes(probes, bloom.m, bloom.k)].all(axis=0).mean())
    return {
        "file": str(path),
        "bytes": path.stat().st_size,
        "m_bits": bloom.m,
        "k": bloom.k,
        "distinct_prompts": bloom.n,
        "prompts_checked": len(digests) // 16,
        "missing": missing,
        "list_matches": bloom.list_digest == _list_digest(entries),
        "false_positive_rate": fp,
        "expected_false_positive_rate": round(bloom.false_positive_rate(), 5),
    }


_FILTER: Bloom | None = None


def legacy_filter() -> Bloom:
    """The committed filter, loaded once per process; refuses one built for a different list."""
    global _FILTER
    if _FILTER is None:
        bloom = Bloom.from_bytes(FILTER_PATH.read_bytes())
        if bloom.list_digest != _list_digest(LEGACY_TRAINING):
            raise RuntimeError(
                f"{FILTER_PATH} was built for another LEGACY_TRAINING list: "
                "rebuild it with `python -m canvasq.testbed.ledger build`"
            )
        _FILTER = bloom
    return _FILTER


def in_legacy_training(prompt: str) -> bool:
    """True for every prompt the committed weights were trained on (and ~1 % of the others)."""
    return prompt in legacy_filter()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "check"])
    ap.add_argument("--path", type=Path, default=FILTER_PATH)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fp-rate", type=float, default=0.01, help="build: the target false-positive rate")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.command == "build":
        bloom = build(args.path, args.workers, args.fp_rate)
        print(
            f"{args.path}: {bloom.n} distinct prompts, m={bloom.m} bits, k={bloom.k}, "
            f"{args.path.stat().st_size} bytes, expected false positives "
            f"{bloom.false_positive_rate():.4f} ({time.time() - t0:.0f}s)"
        )
        return 0
    report = check(args.path, args.workers)
    report["seconds"] = round(time.time() - t0, 1)
    print(report)
    return 0 if report["missing"] == 0 and report["list_matches"] else 1


if __name__ == "__main__":
    sys.exit(main())
