"""Attention kernels over the paged KV cache: decode (flash-decoding) and prefill over a cached prefix. The vision
encoder's non-causal varlen attention is in varlen_attention.py. Semantics: engine/ops/attention.py (the `*_ref`
functions).

One long prefill with nothing cached before it (a new prompt's time to first token) goes to cuDNN's fused
attention instead on Hopper (`DENSE_PREFILL_MIN_TOKENS`), where it is faster than the kernel here
(BENCHMARKS.md, "Dense prefill attention"); its K/V are copied out of the cache for it (an fp8 cache's decoded).

All of them share `attend`, the online-softmax loop over one range of keys (fp32 statistics, exp2 with the
scale folded in, tl.dot with fp32 accumulation). Keys are addressed per token: through the block table
(token n of a sequence lives at block_tables[n // block_size], row n % block_size) or contiguously. A token's
head row (D contiguous elements) is the unit of coalescing either way, so every block size (1, 16, 32, ...;
any positive integer works, powers of two turn // and % into shifts) takes the same code path.

An fp8 KV cache (--kv-cache-dtype fp8) arrives as bytes (kv_cache.kernel_view) with KV_FP8 set: each K and V
tile is decoded right after its load, to fp16 when q is 16-bit (q joins it there; fp32 q keeps fp32), so the
softmax runs as on a model-dtype cache and only the bytes read change. fp16 holds every e4m3 value exactly, and
bf16's values up to 65504 (q is clamped there); its dots keep more of p's bits than bf16's. The decode's
instructions are what an fp8 tile costs beyond its bytes: the kernels are memory-bound on a model-dtype cache,
and the integer decode (kv_cache.fp8e4m3_to_float, for sm80/86) makes them instruction-bound (BENCHMARKS.md,
"fp8 KV cache attention"), so FP8_NATIVE (sm89+) decodes with the GPU's conversion instead, and FP8_PACKED
(sm80/86) decodes four bytes per PTX sequence. All are constexprs: the model-dtype kernels compile exactly as
without them.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.ops.attention import AttentionMetadata, dense_causal_attention, fresh_prefill_len
from engine.ops.platform import device_caps
from engine.ops.triton import pdl
from engine.ops.triton.kv_cache import fp8e4m3_to_float, kernel_view

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64   # keys per decode tile: 16 KB of K plus 16 KB of V per stage in bf16 at D=128
SHORT_PREFILL_TOKENS = 2048   # prefills up to this many query tokens take 64-row tiles on Hopper (tile_config)
MAX_SPLITS = 32   # H200 sweep (bench_ops --sweep-splits), batch 1: 32 splits beat 64 at every context (512-8192)
# A fresh prefill of at least this many tokens runs on cuDNN (module docstring): the measured crossover of time
# to first token (below it the K/V copy and the extra launches per layer cost more than cuDNN saves; BENCHMARKS.md).
# Read at call time (bench/dense_prefill.py patches it). Prefill CUDA graphs never take it: they hold two sequences.
DENSE_PREFILL_MIN_TOKENS = 3072


@triton.jit
def attend(acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, n_lo, n_hi, q_pos, qk_scale, stride_b, stride_s,
            offs_d, d_mask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
            MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr,
            FP8_NATIVE: tl.constexpr, FP8_PACKED: tl.constexpr):
    """Online softmax of q ([M, BLOCK_D]) against keys n_lo..n_hi-1. k_ptr/v_ptr already point at the kv
    head (and, unpaged, at the segment's first token). MASKED: mask keys >= n_hi (the range's ragged end);
    CAUSAL: also keys after each row's position q_pos. Unmasked ranges must hold whole tiles only. KV_FP8: K and
    V are e4m3 bytes, decoded after the load to fp16 (16-bit q, taken there too) or fp32 (module docstring)."""
    if KV_FP8:
        if q.dtype.primitive_bitwidth == 16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < n_hi  # also keeps block-table reads inside the sequence's blocks
        if PAGED:
            blk = tl.load(bt_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            row = blk * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_s
        else:
            row = pos.to(tl.int64) * stride_s
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = fp8e4m3_to_float(k, q.dtype, FP8_NATIVE, FP8_PACKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        elif MASKED:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = fp8e4m3_to_float(v, q.dtype, FP8_NATIVE, FP8_PACKED)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def softmax_step(s, m_i, l_i):
    """One tile of the online softmax: scores s (log2 units) against the running max m_i and sum l_i ->
    (probabilities p, the factor alpha that rescales what was accumulated so far, new max, new sum).
    Every row sees at least one key of the first tile it meets (key 0, or the split's first key), so the max
    is finite and no exp2(-inf - -inf) arises."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


# Integer arguments are specialized by Triton on divisibility by 16 unless listed in do_not_specialize. The
# block-table stride is the widest sequence's block count in an eager batch: left specialized, a width not
# seen before compiled a new variant (~1 s) in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, qk_scale,
                   stride_qt, stride_qh, stride_b, stride_s, stride_h, stride_bt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr,
                   FP8_PACKED: tl.constexpr, GDC: tl.constexpr):
    # Grid (decode seq, kv head, split). Decodes come first with one token each, so decode i's query is
    # row i. All GROUP query heads of a kv head share the program, so each K/V tile is read from memory
    # once; they form the M side of tl.dot, padded to BLOCK_G >= 16 rows (masked).
    pdl.start(GDC)   # between q/k norm + RoPE and o_proj (or the split reduction)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The context is cut into NUM_SPLITS tile-aligned pieces from its actual length, so the work is even
    # across splits whatever seq_len is; a short context leaves the later splits empty (n_lo >= n_hi),
    # and a padding sequence (seq_len 0) leaves all of them empty: zeros out, nothing read.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_lo = split * split_len
    n_hi = tl.minimum(n_lo + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    head_off = kvh.to(tl.int64) * stride_h
    acc, m_i, l_i = attend(acc, m_i, l_i, q, k_ptr + head_off, v_ptr + head_off,
                            bt_ptr + seq.to(tl.int64) * stride_bt, n_lo, n_hi, offs_g, qk_scale,
                            stride_b, stride_s, offs_d, d_mask, BLOCK_SIZE, BLOCK_N,
                            PAGED=True, MASKED=True, CAUSAL=False, DOT_PREC=DOT_PREC, KV_FP8=KV_FP8,
                            FP8_NATIVE=FP8_NATIVE, FP8_PACKED=FP8_PACKED)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partial result of this split: normalised output and its log2-sum-exp (-inf when empty).
        idx = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + idx, lse, mask=g_mask)
        tl.store(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)


@triton.jit
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          GDC: tl.constexpr):
    # Grid (decode seq, q head): merge the splits' partial softmaxes, weighting each by exp2(lse - max).
    pdl.start(GDC)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + base + offs_s)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): weights 0, output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=d_mask[None, :],
                other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    out = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["num_decodes", "num_seqs", "stride_bt"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, qk_scale, num_decodes, num_seqs,
                    stride_qt, stride_qh, stride_b, stride_s, stride_h, stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr,
                    FP8_NATIVE: tl.constexpr, FP8_PACKED: tl.constexpr):
    # Grid (q head, query block); the head varies fastest, so the heads sharing a kv head run side by side
    # and reuse its K/V from L2. Query block b of prefill sequence i has the global id
    # qsl[i] // BLOCK_M + i + b: ids increase with i and each sequence owns at least cdiv(q_len, BLOCK_M)
    # of them, so a binary search over query_start_loc finds the owner on the device (no host work list).
    # Ids are taken in reverse so the last blocks of long prompts (the most keys) start first.
    head = tl.program_id(0)
    target = tl.load(qsl_ptr + num_decodes) // BLOCK_M + num_decodes + (tl.num_programs(1) - 1 - tl.program_id(1))
    lo: tl.int32 = num_decodes
    hi: tl.int32 = num_seqs
    while lo < hi:  # first sequence whose first id is > target; the owner is the one before it
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = (target - (q_start // BLOCK_M + seq)) * BLOCK_M  # first query row of this block in the sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # absolute position of query row 0 (bottom-right causal)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m
    # Keys [0, full_hi) are visible to every row of the block (they precede its first row): whole tiles,
    # no mask. Keys [full_hi, kv_hi) run up to the block's last valid row: causal mask. A block past the
    # sequence's queries (the id scheme leaves at most one per sequence) has kv_hi 0 and does nothing.
    kv_hi = tl.where(m0 < q_len, tl.maximum(prefix + tl.minimum(m0 + BLOCK_M, q_len), 0), 0)
    full_hi = tl.minimum(tl.maximum((prefix + m0 + 1) // BLOCK_N * BLOCK_N, 0), kv_hi)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_head = (head // GROUP).to(tl.int64) * stride_h
    bt = bt_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = attend(acc, m_i, l_i, q, k_ptr + kv_head, v_ptr + kv_head, bt, 0, full_hi, q_pos, qk_scale,
                            stride_b, stride_s, offs_d, d_mask, BLOCK_SIZE, BLOCK_N,
                            PAGED=True, MASKED=False, CAUSAL=False, DOT_PREC=DOT_PREC, KV_FP8=KV_FP8,
                            FP8_NATIVE=FP8_NATIVE, FP8_PACKED=FP8_PACKED)
    acc, m_i, l_i = attend(acc, m_i, l_i, q, k_ptr + kv_head, v_ptr + kv_head, bt, full_hi, kv_hi, q_pos,
                            qk_scale, stride_b, stride_s, offs_d, d_mask, BLOCK_SIZE, BLOCK_N,
                            PAGED=True, MASKED=True, CAUSAL=True, DOT_PREC=DOT_PREC, KV_FP8=KV_FP8,
                            FP8_NATIVE=FP8_NATIVE, FP8_PACKED=FP8_PACKED)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with no keys (seq_len 0) stay 0, like the reference
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def fp8_packed(device: torch.device) -> bool:
    """Whether the integer decode runs four bytes at a time in PTX: CUDA without e4m3 conversions (sm80/86)."""
    caps = device_caps(device)
    return caps.ptx and not caps.fp8_tensor_cores


def fp8_native(device: torch.device) -> bool:
    """Whether Triton converts e4m3 on this device: where it has FP8 tensor cores (sm89+), not in the CPU
    interpreter."""
    return device_caps(device).fp8_tensor_cores


def _num_sms(device: torch.device) -> int:
    """SMs to fill (the CPU interpreter's 4 are few, so the tests' tiny batches still exercise several splits)."""
    return device_caps(device).sm_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per decode sequence, from shapes only (so a captured CUDA graph stays valid for any seq_lens):
    about two programs per SM in all, a power of two (the reduction's arange), at most one per key tile of
    the longest context the block table can hold."""
    want = triton.cdiv(2 * _num_sms(device), max(1, num_seqs * num_kv_heads))
    tiles = triton.cdiv(max_context, DECODE_BLOCK_N)
    return max(1, min(triton.next_power_of_2(want), triton.next_power_of_2(tiles), MAX_SPLITS))


def _decode_config(dtype: torch.dtype, device: torch.device):
    """(BLOCK_N, num_warps, num_stages). fp32 (tests only) takes the FMA path of tl.dot, which at 4 warps
    spills registers on sm_90; 8 warps and half the tile keep it spill-free. The CPU interpreter runs the
    production tiles whatever the dtype (fewer, larger tiles are also what make it fast)."""
    if dtype == torch.float32 and device.type == "cuda":
        return DECODE_BLOCK_N // 2, 8, 2
    return DECODE_BLOCK_N, 4, 3


def tile_config(head_dim_padded: int, dtype: torch.dtype, device: torch.device, num_query_tokens: int | None = None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). D=128: 128x128 tiles, 8 warps (two warpgroups for Hopper's
    wgmma), 3 stages, 161 KB of shared memory compiled for sm90 (tests/portable_compile.py): the fastest for a
    long causal prefill on the H200 sweep (bench_ops --sweep-tiles; docs/perf-log.md). A prefill of at most
    SHORT_PREFILL_TOKENS query tokens (`num_query_tokens`) has too few 128-row blocks to fill 132 SMs evenly
    (one image and a question): 64x64 tiles, 4 warps, 2 stages measured faster there
    (bench/image_gpu_parts.py). A head split in two (vision, 64 + 16) runs best at 128x64 with 4 warps.
    fp32 (tests only) runs tl.dot on FMAs: 32x32 tiles, unpipelined, is the spill-free point there."""
    if dtype == torch.float32 and device.type == "cuda":
        return 32, 32, 8, 1
    if head_dim_padded > 128:
        return 64, 32, 4, 2
    if head_dim_padded == 128:
        if _shared_memory(device) < 224 * 1024:
            return 128, 64, 8, 3       # 64 KB compiled for sm80/86/89: fits their 163 / 99 / 99 KB
        if num_query_tokens is not None and num_query_tokens <= SHORT_PREFILL_TOKENS:
            return 64, 64, 4, 2
        return 128, 128, 8, 3
    return 128, 64, 4, 3


def _shared_memory(device: torch.device) -> int:
    """Shared memory one program may opt in to (227 KB on Hopper, 163 KB on A100, 99 KB on RTX 30/40; the
    interpreter has no such limit)."""
    return device_caps(device).shared_memory_per_block


def cudnn_attention_usable(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """cuDNN attention where it was measured to win (Hopper: DeviceCaps.wgmma), for the dtypes and head sizes it
    takes."""
    return (dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 128
            and device_caps(device).wgmma and _cudnn_available())


@functools.cache
def _cudnn_available() -> bool:
    return torch.backends.cudnn.is_available()


def padded_head_dim(head_dim: int) -> int:
    """The head as the kernels tile it: a power of two, and at least 16 because tl.dot needs K >= 16 (the
    kernels' d mask keeps the padding out)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 must not silently drop to tf32 on the GPU


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D] -> new [T, Hq, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches must share one dense layout"
    assert num_q_heads % num_kv_heads == 0
    q = q if q.stride(-1) == 1 else q.contiguous()
    fresh = fresh_prefill_len(md)
    if fresh >= DENSE_PREFILL_MIN_TOKENS and cudnn_attention_usable(q.dtype, head_dim, q.device):
        try:   # an fp8 cache's K/V are decoded to q's dtype as they are copied out (exact)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return dense_causal_attention(q, k_cache, v_cache, md.block_tables[0], fresh, scale)
        except RuntimeError:   # "No available kernel": cuDNN refuses some shapes; the kernels below take all
            pass
    (k_cache, kv_fp8), (v_cache, _) = kernel_view(k_cache), kernel_view(v_cache)
    assert kv_fp8 or q.dtype == k_cache.dtype == v_cache.dtype, \
        f"q {q.dtype} vs cache {k_cache.dtype}: tl.dot needs one dtype"
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    group = num_q_heads // num_kv_heads
    block_d = padded_head_dim(head_dim)
    prec = dot_precision(q.dtype)
    qk_scale = scale * LOG2E
    bt = md.block_tables
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    qsl = md.query_start_loc_cpu
    native = kv_fp8 and fp8_native(q.device)
    packed = kv_fp8 and fp8_packed(q.device)

    num_decodes = md.num_decodes
    if num_decodes > 0:
        splits = decode_num_splits(num_decodes, num_kv_heads, bt.shape[1] * block_size, q.device)
        if splits > 1:
            part_o = torch.empty((num_decodes, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_decodes, num_q_heads, splits), dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out  # unused: the kernel writes the output directly
        block_n, warps, stages = _decode_config(q.dtype, q.device)
        gdc = pdl.options(q.device, num_tokens)
        _decode_kernel[(num_decodes, num_kv_heads, splits)](
            q, k_cache, v_cache, bt, md.seq_lens, out, part_o, part_lse, qk_scale,
            q.stride(0), q.stride(1), *cache_strides, bt.stride(0), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=splits, DOT_PREC=prec, KV_FP8=kv_fp8,
            FP8_NATIVE=native, FP8_PACKED=packed, num_warps=warps, num_stages=stages, **gdc)
        if splits > 1:
            _decode_reduce_kernel[(num_decodes, num_q_heads)](
                part_o, part_lse, out, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, num_warps=4, **gdc)

    num_seqs = md.num_seqs
    if num_seqs > num_decodes:
        block_m, block_n, warps, stages = tile_config(block_d, q.dtype, q.device,
                                                      qsl[num_seqs] - qsl[num_decodes])
        # Number of query-block ids the prefill sequences own under the kernel's id scheme.
        blocks = (qsl[num_seqs] // block_m + num_seqs) - (qsl[num_decodes] // block_m + num_decodes)
        _prefill_kernel[(num_q_heads, blocks)](
            q, k_cache, v_cache, bt, md.seq_lens, md.query_start_loc, out, qk_scale, num_decodes, num_seqs,
            q.stride(0), q.stride(1), *cache_strides, bt.stride(0), out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
            BLOCK_M=block_m, BLOCK_N=block_n, DOT_PREC=prec, KV_FP8=kv_fp8, FP8_NATIVE=native, FP8_PACKED=packed,
            num_warps=warps, num_stages=stages)
    if qsl[num_seqs] < num_tokens:  # tokens outside every sequence: zeros, as the reference leaves them
        out[qsl[num_seqs]:].zero_()
    return out
