"""Image patches in one kernel (Triton version of patchify_ref in engine/ops/pixels.py): one program per output
row (patch), gathering its C x T x P x P bytes (an image's one frame T times over, or a video frame group's T
frames: `frame_stride` 0 or H*W*C), looking each up in the normalization table, in the output dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _patchify_kernel(raw_ptr, table_ptr, out_ptr, width, blocks_per_row, frame_stride, C: tl.constexpr,
                     T: tl.constexpr, P: tl.constexpr, M: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block, inner = row // (M * M), row % (M * M)
    patch_row = (block // blocks_per_row) * M + inner // M
    patch_col = (block % blocks_per_row) * M + inner % M
    j = tl.arange(0, BLOCK)
    mask = j < C * T * P * P
    c = j // (T * P * P)
    frame = (j // (P * P)) % T
    y = patch_row * P + (j // P) % P
    x = patch_col * P + j % P
    at = frame.to(tl.int64) * frame_stride + (y.to(tl.int64) * width + x) * C + c
    value = tl.load(raw_ptr + at, mask=mask, other=0).to(tl.int32)
    out = tl.load(table_ptr + c * 256 + value, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * (C * T * P * P) + j, out.to(out_ptr.dtype.element_ty), mask=mask)


def patchify(raw: torch.Tensor, table: torch.Tensor, patch: int, merge: int, temporal: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    height, width, c = raw.shape[-3:]
    frame_stride = height * width * c if raw.dim() == 4 else 0
    if raw.dim() == 4 and raw.shape[0] != temporal:
        raise ValueError(f"a frame group has {temporal} frames, got {raw.shape[0]}")
    gh, gw = height // patch, width // patch
    row_len = c * temporal * patch * patch
    out = torch.empty((gh * gw, row_len), dtype=dtype, device=raw.device)
    if out.numel():
        _patchify_kernel[(gh * gw,)](raw.contiguous(), table.contiguous(), out, width, gw // merge, frame_stride,
                                     C=c, T=temporal, P=patch, M=merge, BLOCK=triton.next_power_of_2(row_len),
                                     num_warps=4)
    return out
