"""Token embedding lookup (Triton version of embedding_ref). The table may be in GPU memory or in page-locked
host memory: Triton's launcher turns a tensor's data_ptr() into a device pointer (cuPointerGetAttribute), which
for page-locked host memory under unified addressing is a pointer the GPU reads over PCIe. So a host table is
read in place, only the rows a step asks for (tokens x hidden x 2 bytes in bf16), from ids already on the GPU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# One variant for every token count and every rank's row range (they change with the step and the rank).
@triton.jit(do_not_specialize=["vocab_start", "vocab_end"])
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, vocab_start, vocab_end, stride_w,
                      HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    # Grid (tokens, column blocks): a program copies BLOCK contiguous elements of one row (2 KB in bf16), so a
    # single decode token still spreads its row over several programs and PCIe requests.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(ids_ptr + token)
    mine = (tok >= vocab_start) & (tok < vocab_end)
    row = tl.where(mine, tok - vocab_start, 0).to(tl.int64)
    col_mask = cols < HIDDEN
    # Another rank's id reads nothing (no PCIe traffic) and writes zeros.
    values = tl.load(weight_ptr + row * stride_w + cols, mask=col_mask & mine, other=0.0)
    tl.store(out_ptr + token * HIDDEN + cols, values, mask=col_mask)


def embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """ids [...] on the GPU, weight [rows, hidden] on the GPU or in page-locked host memory -> new
    [..., hidden] on ids' device in weight's dtype."""
    hidden = weight.shape[1]
    out = torch.empty((*ids.shape, hidden), dtype=weight.dtype, device=ids.device)
    flat = ids.reshape(-1)
    if flat.numel() == 0 or hidden == 0:
        return out
    if weight.stride(1) != 1:
        raise ValueError("embedding: the table's rows must be contiguous")
    block = min(1024, triton.next_power_of_2(hidden))
    _embedding_kernel[(flat.numel(), triton.cdiv(hidden, block))](
        flat.contiguous(), weight, out, vocab_start, vocab_end, weight.stride(0), HIDDEN=hidden, BLOCK=block,
        num_warps=4 if block >= 512 else 1)
    return out
