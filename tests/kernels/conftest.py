"""Kernel tests run the real Triton kernels: compiled on a CUDA machine, interpreted on CPU.

TRITON_INTERPRET must be set when the `@triton.jit` functions are defined, i.e. when canvasq.kernels is
imported; pytest loads this file before collecting the test modules, so it imports them here and then
restores the variable, so that in-process tests of other packages keep `impl="auto"` == the fast torch
twins on CPU (these tests ask for `impl="triton"` explicitly). Interpreter caveat: bf16 loads are
wrong there, so CPU runs cover fp32 and fp16 only and bf16 tests are marked `gpu`.
"""

import os

if not os.path.exists("/dev/nvidiactl"):
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.experimental.gluon  # noqa: F401  (the interpreter imports it lazily, asserting the mode)

    import canvasq.kernels
    import canvasq.kernels.constrain
    import canvasq.kernels.fp8_grouped
    import canvasq.kernels.moe.kernels
    import canvasq.kernels.moe.w4a8
    import canvasq.kernels.pin
    import canvasq.kernels.rules
    import canvasq.kernels.soft_embed
    import canvasq.kernels.viterbi  # noqa: F401

    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous

import pytest
from kernel_testutil import DEVICE


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True, scope="session")
def _kernels_are_interpreted_on_cpu():
    """Fail loudly if something imported canvasq.kernels before this file could set TRITON_INTERPRET
    (e.g. a root conftest): the kernels would then be compiled for a GPU that is not there."""
    import torch

    if torch.cuda.is_available():
        return
    from canvasq.kernels._dispatch import interpreted
    from canvasq.kernels.moe import kernels as k

    if not interpreted(k._w4_gate_up_kernel):
        pytest.fail(
            "canvasq.kernels was imported before TRITON_INTERPRET=1 was set; set it in the root "
            "conftest (before any canvasq.kernels import) when no GPU is present"
        )
