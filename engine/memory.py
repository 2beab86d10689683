"""How many KV blocks fit: from a memory budget on CPU, and on CUDA from gpu_memory_utilization after the
weights and the activation peak of a profiled worst-case step (as vLLM's profile run does)."""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.logger import init_logger

logger = init_logger(__name__)
GiB = 1 << 30


@dataclass
class MemoryProfile:
    weights_bytes: int
    activation_peak_bytes: int
    kv_budget_bytes: int
    total_bytes: int


def cpu_kv_budget(space_gib: float | None) -> int:
    """Bytes for the KV pool on CPU: the requested GiB (default 2), never more than half of available RAM."""
    available = psutil.virtual_memory().available
    want = int((space_gib if space_gib is not None else 2.0) * GiB)
    budget = min(want, available // 2)
    if budget < want:
        logger.warning("cpu_kv_cache_space %.2f GiB capped to %.2f GiB (half of available RAM)", want / GiB,
                       budget / GiB)
    return budget


def profile_cuda(run_worst_case_step, weights_bytes: int,
                 gpu_memory_utilization: float, device: torch.device) -> MemoryProfile:
    """Run `run_worst_case_step()` (a forward over max_num_batched_tokens plus sampling for max_num_seqs rows),
    record the peak, and give the KV pool what remains of `utilization * total` after weights and that peak."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_worst_case_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory held outside torch's allocator (CUDA context, cuBLAS workspaces, other processes) is also
    # outside our budget: total - free - what torch holds.
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    budget = int(total * gpu_memory_utilization) - weights_bytes - peak - non_torch
    return MemoryProfile(weights_bytes, peak, max(budget, 0), total)
