"""Helpers shared by the kernel tests (imported after conftest has set TRITON_INTERPRET)."""

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# bf16 only where the kernels compile: the interpreter's bf16 loads are wrong
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def poison(shape, dtype, device=DEVICE) -> torch.Tensor:
    """An output buffer full of NaN (ints: a huge value) so a kernel that skips an element is caught."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, 2**30, dtype=dtype, device=device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32 (for quantisation error, where a max-based ratio is noisy)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
