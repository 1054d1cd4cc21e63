# device call, 2026-12-07 13:40 UTC (kind nvidia-h200; ran on an NVIDIA H100 80GB HBM3), carry [".whl"]
CANVASQ_COMMIT=b0481eb TESTS_MORE= SWT=120 BATCHES=4,16 FWT=150 TESTT=40 bash benchmarks/gpu_i34_grouped.sh
