"""The dense MLP's gelu_tanh(gate) * up in one launch against the twin (torch's GELU, then a multiply)."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, ON_GPU, rel_err

from canvasq.kernels.gelu_mul import gelu_mul, gelu_mul_launch, gelu_mul_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 64), (7, 300), (33, 2112)])
def test_gelu_mul_parity(n, inter, dtype):
    gu = (torch.randn(n, 2 * inter, device=DEVICE) * 3).to(dtype)
    y = gelu_mul_launch(gu)
    want = gelu_mul_reference(gu)
    assert y.shape == (n, inter) and y.dtype == dtype
    if ON_GPU:  # the same fp32 expression, contraction and tanhf as torch's CUDA kernel
        assert torch.equal(y, want), (y.float() - want.float()).abs().max()
    else:
        assert rel_err(y, want) < TOL[dtype]
    # both halves matter: swapping gate and up changes the result
    assert rel_err(y, gelu_mul_reference(torch.cat(gu.chunk(2, dim=-1)[::-1], dim=-1))) > 0.1


def test_gelu_mul_strided_rows_and_impls():
    wide = torch.randn(5, 3 * 128, device=DEVICE)
    gu = wide[:, : 2 * 128]  # rows with a stride wider than 2 * Id (a column slice of a wider output)
    assert rel_err(gelu_mul(gu, impl="triton"), gelu_mul_reference(gu)) < TOL[torch.float32]
    assert torch.equal(gelu_mul(gu, impl="torch"), gelu_mul_reference(gu))
    with pytest.raises(ValueError, match="unknown impl"):
        gelu_mul(gu, impl="nope")
