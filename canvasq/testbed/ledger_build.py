"""Building and checking the legacy training ledger's Bloom filter (`ledger`): every legacy training
stream drawn again from `tasks` (2.5 M problems, about 2 minutes on 2 cores).

    python -m canvasq.testbed.ledger_build build
    python -m canvasq.testbed.ledger_build check
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from canvasq.testbed import tasks
from canvasq.testbed.ledger import FILTER_PATH, LEGACY_TRAINING, Bloom, _digest, _list_digest


def _stream_digests(entry: tuple[str, int, int]) -> bytes:
    """One stream's prompts as concatenated 16-byte digests (what crosses the process boundary)."""
    task, seed, n = entry
    return b"".join(_digest(p.prompt) for p in tasks.legacy_generate(task, n, seed))


def legacy_training_prompts(entries=LEGACY_TRAINING):
    """Every legacy training prompt, in `entries`' order (duplicates included)."""
    for task, seed, n in entries:
        for p in tasks.legacy_generate(task, n, seed):
            yield p.prompt


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
