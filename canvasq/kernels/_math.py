"""Device math and launch options shared by the kernels."""

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched with programmatic dependent launch (`_dispatch.pdl`): wait
    until the previous kernel on the stream has finished and its writes are visible (so nothing below
    can race with it), then let the next kernel launch once every program of this one has started. A
    PDL launch can thus start while its predecessor drains, instead of after it: the launch latency
    and the predecessor's last wave overlap. PDL False (CPU, interpreter, before sm_90): nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def rt(v, DT: tl.constexpr):
    """Round an fp32 value to the model dtype and back (what HF's dtype-level op would store)."""
    return v.to(DT).to(tl.float32)
