"""When the public functions may run their Triton kernels.

On CUDA always. On CPU only when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1
was set when canvasq.kernels was imported) and TRITON_INTERPRET=1 is still set at call time: the
kernel tests import the kernels interpreted and then clear the variable, so `impl="auto"` in other
CPU tests keeps the fast torch twins while the kernel tests ask for `impl="triton"` explicitly.
"""

from __future__ import annotations

import functools
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


PDL_ENV = "CANVASQ_PDL"  # "off": launch without programmatic dependent launch


@functools.lru_cache(maxsize=16)
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(t: torch.Tensor, kernel) -> bool:
    """Whether to launch `kernel` on `t`'s device with programmatic dependent launch (Hopper and later,
    compiled, not switched off with CANVASQ_PDL=off). The kernel must start with `_math.pdl_enter`."""
    return (
        t.is_cuda
        and not interpreted(kernel)
        and os.environ.get(PDL_ENV, "on") != "off"
        and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device())
    )


def pdl_kwargs(t: torch.Tensor, kernel) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter (see `pdl`)."""
    on = pdl(t, kernel)
    return {"PDL": on, "launch_pdl": on}
