"""How many bytes the KV pool may take: on CPU from a memory budget; on CUDA from what remains after the weights
and the activation peak of a profiled worst-case step (as vLLM's profile run does) of either
`gpu_memory_utilization * total` or an absolute `gpu_memory_limit`.

Under a limit the engine behaves as on a card of that size: torch's allocator is capped (so an over-use fails with
an out-of-memory error, as it would there), and the budget also sets aside what the utilization's headroom holds
otherwise: the CUDA graph pools and the vision encoder's output cache."""
from __future__ import annotations

import re
from dataclasses import dataclass

import psutil
import torch

from engine.errors import ModelLoadError
from engine.logger import init_logger

logger = init_logger(__name__)
GiB = 1 << 30
# Fixes on a limit that cannot be met, in the order a user would try them.
LIMIT_HINTS = ("use a quantized checkpoint (README: 'Which checkpoint for which GPU')",
               "lower --max-num-batched-tokens, --max-num-seqs or --mm-processor-kwargs '{\"max_pixels\": ...}'",
               "lower --encoder-cache-size", "run with --enforce-eager (no CUDA graph pools)")


@dataclass
class MemoryProfile:
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int        # held outside torch's allocator: CUDA context, libraries (other processes too)
    reserve_bytes: int          # set aside under a limit: CUDA graph pools + encoder cache + slack (0 otherwise)
    kv_budget_bytes: int        # may be <= 0: nothing left for the KV pool
    total_bytes: int            # the device's memory
    limit_bytes: int | None = None
    prefill_graphs: bool = True  # False: under a limit, the pool cannot spare their scratch (decode graphs only)

    @property
    def usable_bytes(self) -> int:
        return self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes + self.reserve_bytes + \
            self.kv_budget_bytes

    def describe(self) -> str:
        """The numbers behind the budget, for the start-up log and for errors."""
        cap = (f"limit {self.limit_bytes / GiB:.2f} GiB (--gpu-memory-limit) of {self.total_bytes / GiB:.2f} GiB"
               if self.limit_bytes is not None else f"{self.total_bytes / GiB:.2f} GiB total")
        return (f"weights {self.weights_bytes / GiB:.2f} GiB, activation peak {self.activation_peak_bytes / GiB:.2f}"
                f" GiB, outside torch {self.non_torch_bytes / GiB:.2f} GiB, "
                f"graphs{'' if self.prefill_graphs else ' (decode only)'} + encoder cache + slack "
                f"{self.reserve_bytes / GiB:.2f} GiB, KV cache {max(self.kv_budget_bytes, 0) / GiB:.2f} GiB; {cap}")


def usable_bytes(total: int, gpu_memory_utilization: float, limit: int | None) -> int:
    """What the whole engine may take: the absolute limit when given, else the utilization's share of total."""
    return limit if limit is not None else int(total * gpu_memory_utilization)


def kv_budget(usable: int, weights: int, activation_peak: int, non_torch: int, reserve: int = 0) -> int:
    """Bytes left for the KV pool (negative when even the fixed costs do not fit)."""
    return usable - weights - activation_peak - non_torch - reserve


def check_limit(limit: int, total: int, non_torch: int) -> None:
    """A limit the device can hold, with room left after what torch does not allocate (the CUDA context...)."""
    if limit > total:
        raise ModelLoadError(f"--gpu-memory-limit {limit / GiB:.2f} GiB is more than this GPU has "
                             f"({total / GiB:.2f} GiB); lower it, or leave it out to use --gpu-memory-utilization")
    if limit <= non_torch:
        raise ModelLoadError(f"--gpu-memory-limit {limit / GiB:.2f} GiB leaves nothing for the engine: "
                             f"{non_torch / GiB:.2f} GiB of this GPU is already held outside torch (CUDA context, "
                             f"other processes)")


def allocator_fraction(limit: int, non_torch: int, total: int) -> float:
    """torch's per-process cap, as a fraction of the device: the limit minus what is held outside torch."""
    return max(limit - non_torch, 0) / total


def check_weights_fit(limit: int, weights: int, non_torch: int) -> None:
    if weights + non_torch > limit:
        raise ModelLoadError(
            f"the model's weights ({weights / GiB:.2f} GiB) do not fit under --gpu-memory-limit {limit / GiB:.2f} "
            f"GiB ({non_torch / GiB:.2f} GiB of it is held outside torch: CUDA context); "
            f"{LIMIT_HINTS[0]} or raise the limit")


def no_kv_room_message(profile: MemoryProfile, bytes_per_block: int, block_size: int) -> str:
    """Why the KV pool cannot hold one block, with the numbers and what to change."""
    where = "--gpu-memory-limit" if profile.limit_bytes is not None else "--gpu-memory-utilization"
    hints = "; ".join(LIMIT_HINTS) if profile.limit_bytes is not None else \
        "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller or quantized model"
    return (f"no memory left for the KV cache under {where} (one block of {block_size} tokens needs "
            f"{bytes_per_block / 2**20:.1f} MiB): {profile.describe()}. To make room: {hints}")


def encoder_cache_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Device bytes of a full vision-encoder output cache: per LLM token, the merger's row and the deepstack rows."""
    if config.vision is None:
        return 0
    rows = 1 + len(config.vision.deepstack_visual_indexes)
    return tokens * rows * config.vision.out_hidden_size * torch.tensor([], dtype=dtype).element_size()


def cpu_kv_budget(space_gib: float | None) -> int:
    """Bytes for the KV pool on CPU: the requested GiB (default 2), never more than half of available RAM."""
    available = psutil.virtual_memory().available
    want = int((space_gib if space_gib is not None else 2.0) * GiB)
    budget = min(want, available // 2)
    if budget < want:
        logger.warning("cpu_kv_cache_space %.2f GiB capped to %.2f GiB (half of available RAM)", want / GiB,
                       budget / GiB)
    return budget


# ---- CUDA ----------------------------------------------------------------------------------------------------
def non_torch_bytes(device: torch.device) -> int:
    """Device memory held outside torch's allocator (CUDA context, cuBLAS, other processes): total - free -
    what torch holds."""
    free, total = torch.cuda.mem_get_info(device)
    return max(total - free - torch.cuda.memory_reserved(device), 0)


def cuda_index(device: torch.device) -> int:
    """set_per_process_memory_fraction wants an index, and torch.device("cuda") carries none."""
    return torch.cuda.current_device() if device.index is None else device.index


def apply_gpu_memory_limit(limit_gib: float | None, device: torch.device) -> int | None:
    """Cap torch's allocator so that this process stays under `limit_gib` (with what it holds outside torch);
    returns the limit in bytes, or None when there is none (or no GPU: then the KV pool comes from
    --cpu-kv-cache-space)."""
    if limit_gib is None:
        return None
    if device.type != "cuda":
        logger.warning("--gpu-memory-limit %.2f GiB applies to CUDA devices only: ignored on %s (the KV pool comes "
                       "from --cpu-kv-cache-space)", limit_gib, device)
        return None
    limit = int(limit_gib * GiB)
    total = torch.cuda.mem_get_info(device)[1]
    outside = non_torch_bytes(device)
    check_limit(limit, total, outside)
    torch.cuda.set_per_process_memory_fraction(allocator_fraction(limit, outside, total), cuda_index(device))
    logger.info("GPU memory limit: %.2f GiB of %.2f GiB (torch's allocator capped at %.2f GiB; %.2f GiB held "
                "outside it)", limit / GiB, total / GiB, (limit - outside) / GiB, outside / GiB)
    return limit


def hold_to_limit(limit: int, device: torch.device) -> int:
    """Once the engine is ready (pool allocated, graphs captured): what it holds now, outside torch (the CUDA
    context, kernels' code, instantiated graphs, libraries' workspaces) and in torch's allocator, against the
    limit, logged; torch's cap follows what is now held outside it, so that nothing that allocates later (a
    first image, a burst) takes the process past the limit: it fails as it would on a card of that size.
    Returns the bytes held (nvidia-smi's count for this process, as far as this process can see it)."""
    torch.cuda.synchronize(device)
    total = torch.cuda.mem_get_info(device)[1]
    outside, reserved = non_torch_bytes(device), torch.cuda.memory_reserved(device)
    held = outside + reserved
    torch.cuda.set_per_process_memory_fraction(allocator_fraction(limit, outside, total), cuda_index(device))
    if held > limit:
        logger.warning("GPU memory after start-up: %.2f GiB held, over --gpu-memory-limit %.2f GiB by %.0f MiB "
                       "(outside torch %.2f GiB, torch's allocator %.2f GiB); torch's allocator is capped at what "
                       "is left", held / GiB, limit / GiB, (held - limit) / 2**20, outside / GiB, reserved / GiB)
    else:
        logger.info("GPU memory after start-up: %.2f GiB held of --gpu-memory-limit %.2f GiB (outside torch %.2f "
                    "GiB, torch's allocator %.2f GiB, of which free for steps %.2f GiB)", held / GiB, limit / GiB,
                    outside / GiB, reserved / GiB, (limit - held) / GiB)
    return held


def _oom_summary(err: Exception) -> str:
    """torch's out-of-memory message cut to what it tried ("CUDA out of memory. Tried to allocate 2.00 GiB")."""
    m = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(err))
    return "out of memory" + (f": tried to allocate {m.group(1)}" if m else "")


def weights_out_of_memory(limit: int, device: torch.device, err: Exception) -> ModelLoadError:
    """The error for a load that ran out of memory under the limit (the weights alone do not fit)."""
    placed = torch.cuda.memory_allocated(device)
    return ModelLoadError(
        f"the model's weights do not fit under --gpu-memory-limit {limit / GiB:.2f} GiB: loading them ran "
        f"{_oom_summary(err)} with {placed / GiB:.2f} GiB placed; {LIMIT_HINTS[0]} or raise the limit")


def steps_out_of_memory(limit: int, weights: int, err: Exception) -> ModelLoadError:
    """The error for a profiled step that ran out of memory under the limit."""
    return ModelLoadError(
        f"the worst-case step (max_num_batched_tokens tokens, max_num_seqs rows sampled, the largest image) "
        f"does not fit under --gpu-memory-limit {limit / GiB:.2f} GiB beside the weights ({weights / GiB:.2f} "
        f"GiB): {_oom_summary(err)}; {LIMIT_HINTS[1]}")


def profile_cuda(run_worst_case_step, weights_bytes: int, gpu_memory_utilization: float, device: torch.device,
                 limit: int | None = None, reserve_bytes: int = 0) -> MemoryProfile:
    """Run `run_worst_case_step()` (a forward over max_num_batched_tokens plus sampling for max_num_seqs rows),
    record the peak, and give the KV pool what remains of the usable memory after weights and that peak (and,
    under a limit, `reserve_bytes`)."""
    if limit is not None:
        check_weights_fit(limit, weights_bytes, non_torch_bytes(device))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device) if limit is not None else torch.cuda.memory_allocated(device)
    try:
        run_worst_case_step()
    except torch.cuda.OutOfMemoryError as err:
        if limit is None:
            raise
        raise steps_out_of_memory(limit, weights_bytes, err) from None
    torch.cuda.synchronize(device)
    # Under a limit, what the allocator reserves is what its cap counts (blocks split and kept, not only in use).
    peak = (torch.cuda.max_memory_reserved(device) if limit is not None
            else torch.cuda.max_memory_allocated(device)) - before
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(device)[1]
    outside = non_torch_bytes(device)
    if limit is not None:
        # What is held outside torch may have grown (cuBLAS, Triton modules): keep the allocator's cap in step.
        torch.cuda.set_per_process_memory_fraction(allocator_fraction(limit, outside, total), cuda_index(device))
    else:
        reserve_bytes = 0
    budget = kv_budget(usable_bytes(total, gpu_memory_utilization, limit), weights_bytes, peak, outside,
                       reserve_bytes)
    return MemoryProfile(weights_bytes, peak, outside, reserve_bytes, budget, total, limit)
