"""Image patches: uint8 pixels [H, W, C] -> the vision encoder's rows [N, C*T*P*P], each a patch repeated over the
T temporal frames (a video's frame group, [T, H, W, C], gives each of its T frames instead), rows in merge-block order (each M x M block of patches contiguous), every value looked up in
a [C, 256] table of what each 8-bit value of each channel normalizes to. The table holds exactly the
reference's arithmetic per value (engine/inputs/image_processor.py builds it), so both paths give its numbers
bit for bit; on CUDA one kernel writes them in the model's dtype, in place of ~8 torch kernels and 3 casts."""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton


def patchify_ref(raw: torch.Tensor, table: torch.Tensor, patch: int, merge: int, temporal: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw uint8 [H, W, C] or [T, H, W, C] (H, W multiples of patch * merge), table float32 [C, 256] ->
    [N, C*T*P*P] in dtype."""
    frames = raw if raw.dim() == 4 else raw.unsqueeze(0)
    n, height, width, c = frames.shape
    p, m, t = patch, merge, temporal
    if n not in (1, t):
        raise ValueError(f"a frame group has {t} frames, got {n}")
    gh, gw = height // p, width // p
    x = table[torch.arange(c, device=raw.device), frames.long()]       # [n, H, W, C] normalized values
    x = x.permute(3, 0, 1, 2).reshape(c, n, gh // m, m, p, gw // m, m, p)
    x = x.permute(2, 5, 3, 6, 0, 1, 4, 7)             # (block row, block col, inner row, inner col, C, n, P, P)
    x = x.expand(*x.shape[:5], t, p, p)               # a still image repeated over the temporal patch
    return x.reshape(gh * gw, c * t * p * p).to(dtype).contiguous()


def patchify(raw: torch.Tensor, table: torch.Tensor, patch: int, merge: int, temporal: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if use_triton(raw):
        from engine.ops.triton import pixels
        return pixels.patchify(raw, table, patch, merge, temporal, dtype)
    return patchify_ref(raw, table, patch, merge, temporal, dtype)
