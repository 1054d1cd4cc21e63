"""Settings every test directory shares (each directory's own conftest adds its fixtures)."""

import os

# oneDNN's AMX / AVX512-FP16 kernels (newer Xeons) round fp16 matmuls differently from the AVX-512
# ones: on such a CPU the runtime's fp16 logits (interpreted attention kernel) moved by 8 % against
# HF's, 2 % being the bound, and pass with this setting. The tolerances are set for the AVX-512 kernels,
# so every run uses them (read at oneDNN's first primitive; worker processes inherit it).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")

# Under pytest-xdist (the README's `-n 4` on CI's 2 cores) every test process and the processes it
# starts run torch on one thread: four workers each spinning two OpenMP threads oversubscribed the
# cores (a 39 s benchmark dry run took 440 s in CI). Set before torch is imported anywhere.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
