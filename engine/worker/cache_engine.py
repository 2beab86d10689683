"""The KV cache tensors: one GPU pool for all layers and, with swap space, a (pinned) CPU pool of the same
block shape. Layout [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]: a layer's K or V
is a contiguous [num_blocks, block_size, Hk, D] view, and a swap moves a block of every layer in one copy.
Under tensor parallelism each rank caches its own KV heads (ModelConfig.kv_heads_per_rank), with the same block
ids on every rank.

The pool's dtype is the KV cache dtype (--kv-cache-dtype): the model dtype, or float8_e4m3fn (one byte per
element, scale 1.0; engine/ops/kv_cache.py writes it, the attention ops upcast what they read). Swaps copy
bytes (uint8 views), which works for every dtype and is exact; torch has no CPU index_copy_ for float8."""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.distributed.parallel_state import get_tp_size
from engine.ops.kv_cache import FP8_KV_DTYPE


class CacheEngine:
    def __init__(self, config: ModelConfig, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (config.num_hidden_layers, 2, num_gpu_blocks, block_size, config.kv_heads_per_rank(get_tp_size()),
                 config.head_dim)
        self.gpu_cache = torch.empty(shape, dtype=dtype, device=device)
        self.cpu_cache = None
        if num_cpu_blocks > 0:
            cpu_shape = shape[:2] + (num_cpu_blocks,) + shape[3:]
            self.cpu_cache = torch.empty(cpu_shape, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
        self.device = device
        self.dtype = dtype

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.gpu_cache]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block on this rank (`dtype`: the KV cache dtype)."""
        return config.kv_bytes_per_token(get_tp_size()) * block_size * torch.empty((), dtype=dtype).element_size()

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu_block, cpu_block) pairs: gather the GPU blocks, one device-to-host copy, scatter on the host."""
        if not pairs:
            return
        gpu_ids = torch.tensor([g for g, _ in pairs], device=self.device)
        cpu_ids = torch.tensor([c for _, c in pairs])
        staged = _bytes(self.gpu_cache).index_select(2, gpu_ids).to("cpu")
        _bytes(self.cpu_cache).index_copy_(2, cpu_ids, staged)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu_block, gpu_block) pairs: gather on the host, one host-to-device copy, scatter on the device."""
        if not pairs:
            return
        cpu_ids = torch.tensor([c for c, _ in pairs])
        gpu_ids = torch.tensor([g for _, g in pairs], device=self.device)
        staged = _bytes(self.cpu_cache).index_select(2, cpu_ids)
        if self.device.type == "cuda":
            staged = staged.pin_memory()
        _bytes(self.gpu_cache).index_copy_(2, gpu_ids, staged.to(self.device, non_blocking=True))


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto caches K and V in the model dtype; fp8 / fp8_e4m3 in float8_e4m3fn."""
    return model_dtype if name == "auto" else FP8_KV_DTYPE


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (the last dimension times the element size)."""
    return cache.view(torch.uint8)
