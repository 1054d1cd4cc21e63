"""When the public functions may run their Triton kernels.

On CUDA always. On CPU only when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1
was set when canvasq.kernels was imported) and TRITON_INTERPRET=1 is still set at call time: the
kernel tests import the kernels interpreted and then clear the variable, so `impl="auto"` in other
CPU tests keeps the fast torch twins while the kernel tests ask for `impl="triton"` explicitly.
"""

from __future__ import annotations

import os

import torch


def interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def can_launch(t: torch.Tensor, kernel) -> bool:
    """Triton kernels can run on this tensor's device (CUDA, or CPU through the interpreter)."""
    return t.is_cuda or interpreted(kernel)


def auto_triton(t: torch.Tensor, kernel) -> bool:
    """What `impl="auto"` picks."""
    return t.is_cuda or (interpreted(kernel) and os.environ.get("TRITON_INTERPRET") == "1")
