"""SwiGLU activation silu(gate) * up over a fused [.., 2*d] gate_up projection (Triton version of
silu_and_mul_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, d, BLOCK: tl.constexpr, GDC: tl.constexpr):
    # Grid (rows, column blocks): a row of d = 12288 is 12 programs, so even one decode token spreads
    # over several SMs, and 8192 prefill tokens give ~100K programs of 1024 contiguous elements each.
    pdl.start(GDC)   # between gate_up_proj and down_proj
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # torch rounds silu(gate) to the tensor dtype before the multiply; keep that rounding point.
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] laid out as [gate | up] -> new [..., d]."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = out.numel() // d if d else 0
    if rows == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])  # a view whenever the leading dims allow it; rows may be strided
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x2, out, x2.stride(0), d, BLOCK=block,
                                                        num_warps=4 if block >= 512 else 1,
                                                        **pdl.options(x.device, rows))
    return out
