"""Settings every test directory shares (each directory's own conftest adds its fixtures)."""

import os

# oneDNN's AMX / AVX512-FP16 kernels (newer Xeons) round fp16 matmuls differently from the AVX-512
# ones: on such a CPU the runtime's fp16 logits (interpreted attention kernel) moved by 8 % against
# HF's, 2 % being the bound, and pass with this setting. The tolerances are set for the AVX-512 kernels,
# so every run uses them (read at oneDNN's first primitive; worker processes inherit it).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")

# Under pytest-xdist (the README's `-n 6` on CI's 2 cores) every test process and the processes it
# starts run torch on one thread: four workers each spinning two OpenMP threads oversubscribed the
# cores (a 39 s benchmark dry run took 440 s in CI). Set before torch is imported anywhere.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


# Long tests first: pytest-xdist hands the first items out round-robin, so the tests that wait on real
# worker processes, services and compiles start on every worker at once instead of leaving one worker
# running them after the rest has finished. Order only.
LONG_FIRST = (
    "tests/reliability/",
    "tests/serve/",
    "tests/test_e2e_service.py",
    "tests/cli/test_resume.py",
    "tests/test_bench_scripts.py",
    "tests/kernels/test_benchmarks_quick.py",
    "tests/kernels/test_runtime_fused.py",
)


def pytest_collection_modifyitems(config, items):
    def long(item) -> bool:
        path = item.nodeid.split("::")[0]
        return path.startswith(LONG_FIRST) or item.get_closest_marker("slow") is not None

    items.sort(key=lambda item: not long(item))  # stable: the order within each group is kept


# CANVASQ_TEST_CPU=FILE: append "seconds<TAB>nodeid" per test, the CPU (user + system) its process and
# the children it waited for used, to find what CI's 2 cores spend (a CI-time tool; off by default).
if os.environ.get("CANVASQ_TEST_CPU"):
    import resource

    import pytest

    def _cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = _cpu()
        try:
            return (yield)
        finally:
            with open(os.environ["CANVASQ_TEST_CPU"], "a") as f:
                f.write(f"{_cpu() - start:.2f}\t{item.nodeid}\n")
