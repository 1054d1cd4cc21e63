"""Device math and launch options shared by the kernels."""

import triton
import triton.language as tl
from triton.language.extra import libdevice

NO_FP_FUSION = {"enable_fp_fusion": False}  # launch option: keep every rounding where it is written


@triton.jit
def tanh(z, INTERPRETED: tl.constexpr):
    """CUDA's tanhf (libdevice), what torch's tanh and tanh-GELU call on the GPU, so results match
    torch bit for bit there. Triton 3.6's interpreter has no libdevice: on CPU the kernels take
    tanh through the sigmoid (a few fp32 ulps off; the CPU tests compare with tolerances)."""
    if INTERPRETED:
        return 2.0 * tl.sigmoid(2.0 * z) - 1.0
    else:
        return libdevice.tanh(z)
