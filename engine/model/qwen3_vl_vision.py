"""Qwen3-VL vision encoder (ViT + 2x2 patch merger + deepstack mergers), matching transformers' Qwen3VLVisionModel.

Input: pixel_values [N, C*T*P*P], the patches of all images back to back (each image's rows in merge-block
order: for each 2x2 block, its four patches row-major), and grid_thw [num_images, 3] in patches.
Output: the merged embeddings [N/4, out_hidden] that replace the <|image_pad|> tokens, and the deepstack
features [num_deepstack, N/4, out_hidden] added to the decoder's first layers' hidden states.

  x = patch_embed(pixels) + interpolated position table        (one Linear == the checkpoint's Conv3d)
  for each block: x += proj(attn(LN1 x, 2D rotary, per-frame)); x += fc2(gelu_tanh(fc1(LN2 x)))
                  (each residual add runs inside the LayerNorm that follows it: ops.layer_norm)
                  after block deepstack_visual_indexes[k]: deepstack_k = merger_k(x)  (LayerNorm after view)
  out = merger(x)                                                                     (LayerNorm before view)

What depends only on an image's grid (the resampled position rows and the rotary cos/sin) is computed once
per (t, h, w) and cached, so a repeated image size costs nothing but the cache lookup.
"""
from __future__ import annotations

import itertools
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.errors import ModelLoadError
from engine import ops

LAYER_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10_000.0     # vision_config.rope_parameters.rope_theta of every released Qwen3-VL
GRID_CACHE_SIZE = 64              # distinct image sizes kept (oldest evicted first)

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, **kw):
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported vision hidden_act {act!r} (supported: {', '.join(_ACTIVATIONS)})")
        self.linear_fc1 = nn.Linear(dim, hidden, **kw)
        self.linear_fc2 = nn.Linear(hidden, dim, **kw)
        self.act = _ACTIVATIONS[act]
        self.tanh_gelu = act in _TANH_GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tanh_gelu and x.is_cuda and x.dim() == 2:
            # cuBLASLt applies the bias and the tanh GELU in the GEMM's epilogue, on the fp32 accumulator:
            # the [4096, 4304] intermediate is written once instead of written, read and written again.
            h = torch._addmm_activation(self.linear_fc1.bias, x, self.linear_fc1.weight.t(), use_gelu=True)
            return self.linear_fc2(h)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, **kw):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, **kw)
        self.proj = nn.Linear(dim, dim, **kw)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = ops.vision_qkv_rope(self.qkv(x).view(n, 3, self.num_heads, self.head_dim), cos, sin)
        out = ops.varlen_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, **kw):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, **kw)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, **kw)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads, **kw)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, **kw)

    def forward(self, x, delta, cos, sin, cu_seqlens, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering the block is x + delta (delta: the previous block's MLP output, not yet
        added, or None). Returns (the stream after attention, this block's MLP output): the caller, or the next
        block's first norm, adds the two."""
        h, x = _add_norm(self.norm1, x, delta)
        h, x = _add_norm(self.norm2, x, self.attn(h, cos, sin, cu_seqlens, max_seqlen))
        return x, self.mlp(h)


def _add_norm(norm: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x + delta), x + delta), with the add and the norm in one kernel."""
    if delta is None:
        return ops.layer_norm(x, norm.weight, norm.bias, norm.eps), x
    return ops.layer_norm(delta, norm.weight, norm.bias, norm.eps, residual=x)


class PatchMerger(nn.Module):
    """Concatenate each 2x2 block's four patch vectors, then LayerNorm -> fc1 -> GELU(erf) -> fc2.
    The final merger normalizes each patch before the concatenation (norm over hidden); the deepstack mergers
    normalize the concatenated vector (postshuffle norm over 4 * hidden)."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool, **kw):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else cfg.hidden_size, eps=LAYER_NORM_EPS, **kw)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, **kw)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.table_side = int(round(config.num_position_embeddings ** 0.5))
        if self.table_side ** 2 != config.num_position_embeddings:
            raise ModelLoadError(f"num_position_embeddings {config.num_position_embeddings} is not a square")
        self.rope_theta = float(getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA)
        self.deepstack_indexes = list(config.deepstack_visual_indexes)

        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(self.patch_dim, config.hidden_size, **kw)   # Conv3d weight, flattened
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size, **kw)
        self.blocks = nn.ModuleList(VisionBlock(config, **kw) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False, **kw)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True, **kw) for _ in self.deepstack_indexes)
        self._grid_cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_prepared(pixel_values, *self.prepare(pixel_values, grid_thw))

    def prepare(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """The host-side part of forward: checks, and the per-patch tensors the grids imply -- position rows,
        rotary cos and sin, the attention segments (cu_seqlens, max_seqlen). The rest (forward_prepared)
        is device work only, so a CUDA graph can hold it."""
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        self._check_inputs(pixel_values, grids)
        # One attention segment per frame (h * w patches), as transformers' get_vision_cu_seqlens does.
        max_seqlen = max(h * w for _, h, w in grids)
        if len(grids) == 1:     # the grid's cached tensors themselves: no copies, no host-to-device transfer
            return (*self._grid_tensors(grids[0]), max_seqlen)
        per_grid = [self._grid_tensors(g)[:3] for g in grids]
        pos, cos, sin = (torch.cat(parts) for parts in zip(*per_grid))
        seqlens = [h * w for t, h, w in grids for _ in range(t)]
        cu_seqlens = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)
        return pos, cos, sin, cu_seqlens.to(self.pos_embed.weight.device, non_blocking=True), max_seqlen

    def forward_prepared(self, pixel_values, pos, cos, sin, cu_seqlens, max_seqlen: int):
        weight = self.pos_embed.weight
        x = self.patch_embed.proj(pixel_values.to(device=weight.device, dtype=weight.dtype)) + pos
        deepstack, delta = [], None
        for i, block in enumerate(self.blocks):
            x, delta = block(x, delta, cos, sin, cu_seqlens, max_seqlen)
            if i in self.deepstack_indexes:
                x, delta = x + delta, None
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        out = self.merger(x if delta is None else x + delta)
        deepstack = torch.stack(deepstack) if deepstack else out.new_empty((0,) + out.shape)
        return out, deepstack

    def _check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_dim:
            raise ValueError(f"pixel_values must be [N, {self.patch_dim}], got {list(pixel_values.shape)}")
        if not grids:
            raise ValueError("grid_thw is empty")
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
                raise ValueError(f"grid (t={t}, h={h}, w={w}) must be positive with h, w multiples of {self.merge}")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thw covers {total} patches but pixel_values has {pixel_values.shape[0]} rows")

    # ---- per-grid constants (cached) -----------------------------------------------------------------------
    def _grid_tensors(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        """(position rows [t*h*w, hidden] in the model dtype, rotary cos and sin [t*h*w, head_dim/2] fp32,
        all in merge-block order and repeated for each of the t frames; the frames' segment bounds
        cu_seqlens [t + 1] int32). Callers must not modify them: they are shared."""
        hit = self._grid_cache.get(grid)
        if hit is None:
            t, h, w = grid
            rows, cols = self._merge_order_coords(h, w)
            cos, sin = self._rotary(rows, cols)
            cu_seqlens = torch.arange(0, (t + 1) * h * w, h * w, dtype=torch.int32, device=rows.device)
            hit = (self._interpolated_positions(rows, cols, h, w).repeat(t, 1), cos.repeat(t, 1), sin.repeat(t, 1),
                   cu_seqlens)
            if len(self._grid_cache) >= GRID_CACHE_SIZE:
                self._grid_cache.pop(next(iter(self._grid_cache)))
            self._grid_cache[grid] = hit
        return hit

    def _merge_order_coords(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of each patch of one frame, listed block by block: (block row, block col, in row, in col)."""
        m, dev = self.merge, self.pos_embed.weight.device
        rows = torch.arange(h, device=dev).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w, device=dev).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)

    def _interpolated_positions(self, rows, cols, h: int, w: int) -> torch.Tensor:
        """Bilinear resampling of the side x side learned table to h x w, align_corners=True: output row r reads
        source coordinate r * (side - 1) / (h - 1). Weighted sum of the 4 neighbours in fp32, cast once."""
        side = self.table_side

        def taps(index: torch.Tensor, size: int):
            src = index.float() * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo = lo.long()
            return lo, (lo + 1).clamp(max=side - 1), 1 - frac, frac

        r0, r1, wr0, wr1 = taps(rows, h)
        c0, c1, wc0, wc1 = taps(cols, w)
        table = self.pos_embed.weight.float()
        pos = (table[r0 * side + c0] * (wr0 * wc0)[:, None] + table[r0 * side + c1] * (wr0 * wc1)[:, None]
               + table[r1 * side + c0] * (wr1 * wc0)[:, None] + table[r1 * side + c1] * (wr1 * wc1)[:, None])
        return pos.to(self.pos_embed.weight.dtype)

    def _rotary(self, rows, cols) -> tuple[torch.Tensor, torch.Tensor]:
        """Axial 2D rotary: head_dim/4 frequencies theta^(-2k/(head_dim/2)); angles [row * f | col * f]."""
        quarter = self.config.head_dim // 4
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, 2 * quarter, 2, dtype=torch.float, device=rows.device) / (2 * quarter))
        angles = torch.cat((rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq), dim=-1)
        return angles.cos(), angles.sin()

    def _apply(self, fn, *args, **kwargs):
        self._grid_cache.clear()          # .to(device/dtype) invalidates the cached per-grid tensors
        return super()._apply(fn, *args, **kwargs)

    # ---- weights -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> set[str]:
        """Copy checkpoint tensors (names without the `model.visual.` prefix) into the parameters, casting to
        the model dtype; the Conv3d patch-embedding weight [hidden, C, T, P, P] is flattened to the Linear's
        [hidden, C*T*P*P]. Returns the names loaded; with strict=True, raises if any parameter is missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise ModelLoadError(f"unexpected vision weight {name!r} in the checkpoint")
            param = params[name]
            if name == "patch_embed.proj.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(f"vision weight {name!r} has shape {list(tensor.shape)}, "
                                     f"expected {list(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            loaded.add(name)
        self._grid_cache.clear()          # the position rows depend on pos_embed.weight
        if strict:
            self.check_all_loaded(loaded)
        return loaded

    def check_all_loaded(self, loaded: set[str]) -> None:
        """Raise ModelLoadError naming every parameter not in `loaded` (checkpoint names, prefix stripped)."""
        missing = sorted(set(dict(self.named_parameters())) - set(loaded))
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} vision tensor(s): "
                                 + ", ".join(f"model.visual.{n}" for n in missing), code="missing_weights")
