"""Split-K, shared by the quantized linears' weight-streaming kernels (the 4-bit GEMV and GEMM, the FP8 GEMV and
one-launch W8A8 kernel).

With few output tiles (one token, a narrow projection) the grid also splits K into `split` ranges, so that more
programs stream the weight at once. Each program of a split launch stores its float32 sums in a [split, M, N]
buffer and reduce_partials adds the ranges and the bias into the output; with split 1 the kernel writes the
output itself. A kernel ends with store_output either way, or with splitk_epilogue, whose SERIAL form lets the
last program of each tile (an atomic counter per tile, in split_locks) sum the ranges in split order: one launch
instead of two, and the same result whichever split finishes first. split_targets gives such a launch its buffers
and, where there are no counters, the second kernel after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped order: GROUP_M row tiles walk the same weight columns together,
    so a weight tile is read from memory once and from L2 by the other row tiles."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def tile_offsets(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column offsets of tile (pid_m, pid_n) and their in-bounds masks."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def store_output(out_ptr, bias_ptr, acc, out_off, part_off, offs_n, n_mask, mask, HAS_BIAS: tl.constexpr,
                 PARTIAL: tl.constexpr):
    """A program's float32 sums `acc` ([BLOCK_N] or [BLOCK_M, BLOCK_N]) at out_off: PARTIAL, as they are at
    part_off + out_off of the partial buffer (the reduction adds the bias once); else plus the bias, in the
    output's dtype."""
    if PARTIAL:
        tl.store(out_ptr + part_off + out_off, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def splitk_epilogue(acc, offs_m, offs_n, M, N, stride_om, bias_ptr, out_ptr, ws_ptr, lock_ptr, tile, pid_k,
                    SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] float32 -> out (one split), or the split's partial (store_output); SERIAL: the tile's last
    split also sums the partials in split order into out."""
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    out_off = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]    # out is contiguous: stride_om == N
    MN = M.to(tl.int64) * N
    if SPLIT == 1:
        store_output(out_ptr, bias_ptr, acc, out_off, 0, offs_n, n_mask, mask, HAS_BIAS, False)
    else:
        store_output(ws_ptr, bias_ptr, acc, out_off, pid_k * MN, offs_n, n_mask, mask, HAS_BIAS, True)
        if SERIAL:
            # Every thread's partial is issued before the counter moves (barrier, then a release at GPU scope);
            # the last split reads the others' partials from L2 (.cg) after its acquire.
            tl.debug_barrier()
            done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                total = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT):
                    total += tl.load(ws_ptr + s * MN + out_off, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(lock_ptr + tile, 0)       # ready for the next launch (and graph replay)
                store_output(out_ptr, bias_ptr, total, out_off, 0, offs_n, n_mask, mask, HAS_BIAS, False)


SMS = 132                   # programs to fill at least twice (H200; more SMs only lengthen the tail a little)


def split_for(programs: int, steps: int, cap: int) -> int:
    """The split (a power of two, at most cap, dividing the K steps) that gives `programs` output tiles at least
    two waves of programs."""
    split = 1
    while programs * split < 2 * SMS and split < cap and steps % (split * 2) == 0:
        split *= 2
    return split


def fit_split(steps: int, split: int) -> int:
    """The largest split <= `split` (a power of two) that divides the K steps: every range is whole steps."""
    while steps % split:
        split //= 2
    return split


def partial_buffer(out: torch.Tensor, split: int) -> torch.Tensor:
    """Where a kernel of `split` K ranges writes: `out` itself, or a float32 [split, M, N] buffer."""
    return torch.empty((split, *out.shape), dtype=torch.float32, device=out.device) if split > 1 else out


def reduce_partials(dst: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the sum of dst's K ranges, plus the bias; nothing to do when the kernel wrote `out` itself."""
    if dst is out:
        return
    mn, block = out.numel(), 1024
    _splitk_reduce_kernel[(triton.cdiv(mn, block),)](dst, bias if bias is not None else out, out, mn, out.shape[-1],
                                                     SPLIT=dst.shape[0], BLOCK=block, HAS_BIAS=bias is not None,
                                                     num_warps=4)


_LOCKS: dict[torch.device, torch.Tensor] = {}
LOCK_SLOTS = 1 << 16


def split_locks(device: torch.device, split: int, tiles: int) -> torch.Tensor | None:
    """The per-device split-K counters for a launch of `tiles` output tiles in `split` K ranges, or None where the
    partials go to a second kernel instead (one range, more tiles than counters). Zero between launches: each
    tile's last program resets its own. Shared by every launch on the device, which the engine issues on one
    stream (a second stream running these kernels at the same time would need its own). Not allocated inside a
    graph capture (the memory would belong to the graph's pool): a capture before any eager call sums its
    partials in a second kernel."""
    if split == 1 or tiles > LOCK_SLOTS:
        return None
    t = _LOCKS.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _LOCKS[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return t


@dataclass(frozen=True)
class SplitTargets:
    """Where a launch with splitk_epilogue writes: `ws` (the partial buffer, or out itself with one range), `locks`
    (the counters, or ws where there are none: the kernel then leaves it alone) and SERIAL."""
    ws: torch.Tensor
    locks: torch.Tensor
    serial: bool

    def finish(self, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """After the launch: the second-kernel reduction where the kernel did not sum the ranges itself."""
        if not self.serial:
            reduce_partials(self.ws, bias, out)


def split_targets(out: torch.Tensor, split: int, tiles: int, serial: bool = True) -> SplitTargets:
    """The buffers for a launch of `tiles` output tiles in `split` K ranges; serial=False always sums the ranges
    in a second kernel (for A/B)."""
    locks = split_locks(out.device, split, tiles) if serial else None
    ws = partial_buffer(out, split)
    return SplitTargets(ws, locks if locks is not None else ws, locks is not None)
