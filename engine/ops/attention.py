"""Attention over the paged KV cache (decoder) and non-causal varlen attention (vision encoder).

A step's batch is flat: the query tokens of all scheduled sequences back to back, sequence i owning
q[query_start_loc[i]:query_start_loc[i+1]]. Its keys and values are the first seq_lens[i] slots of its blocks
(block_tables[i]), this step's tokens included (they are written by store_kvcache before attention runs).
Queries are the last tokens of the context, so query j of sequence i sits at absolute position
seq_lens[i] - q_len_i + j and sees keys 0..that position (causal, bottom-right aligned). This one rule covers
a plain prefill, a prefill chunk after a cached prefix or earlier chunks, and a decode step (q_len 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.ops.dispatch import use_triton


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: KV slot of each query token (-1: do not write)
    query_start_loc: torch.Tensor   # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor          # [B] int32: context length after this step (0 = padding sequence)
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32 physical block ids (unused tail: any value)
    num_decodes: int                # sequences [0, num_decodes) have exactly one query token
    num_decode_tokens: int          # == num_decodes; the prefill tokens start here
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, so references and grid sizes need no device sync
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        md: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hk, D] -> [T, Hq, D] (fp32 math, GQA)."""
    out = torch.zeros_like(q)
    if md.num_decodes:
        out[:md.num_decodes] = _decode_ref(q[:md.num_decodes], k_cache, v_cache, md, scale)
    for i in range(md.num_decodes, md.num_seqs):
        start, end, ctx = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1], md.seq_lens_cpu[i]
        if end > start and ctx > 0:
            k, v = _gather(k_cache, v_cache, md.block_tables[i:i + 1], ctx)
            out[start:end] = _attend(q[start:end].unsqueeze(0), k, v, scale, torch.tensor([ctx]), causal=True)[0]
    return out


def fresh_prefill_len(md: AttentionMetadata) -> int:
    """n when the step is one prefill of n query tokens with nothing cached before them (its keys are exactly
    its queries, so top-left causal attention over its own K/V computes it), else 0."""
    if md.num_decodes or md.num_seqs != 1:
        return 0
    n = md.query_start_loc_cpu[1] - md.query_start_loc_cpu[0]
    return n if n == md.seq_lens_cpu[0] else 0


def dense_causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           n: int, scale: float) -> torch.Tensor:
    """Causal attention of one fresh sequence (fresh_prefill_len: n) through torch's fused attention: its K/V
    copied out of the paged cache into contiguous [n, Hk, D] tensors (a few MB, against the attention's
    O(n^2) work), GQA without repeating them. q: [T >= n, Hq, D] -> [T, Hq, D], rows past n zero as the
    reference leaves them. The caller picks the backend (sdpa_kernel)."""
    k, v = (t.transpose(1, 2) for t in _gather(k_cache, v_cache, block_table[None], n, q.dtype))
    o = F.scaled_dot_product_attention(q[:n].transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale,
                                       enable_gqa=True)[0].transpose(0, 1)
    if q.shape[0] == n:
        return o.contiguous()   # a no-op where the backend wrote [n, Hq, D] rows (cuDNN follows q's layout)
    out = torch.zeros_like(q)
    out[:n] = o
    return out


def _gather(k_cache, v_cache, block_tables, ctx: int, dtype: torch.dtype = torch.float32):
    """K and V of the first `ctx` slots of each row's blocks: [B, ctx, Hk, D] each, in `dtype`."""
    nblocks = -(-ctx // k_cache.shape[1])
    blocks = block_tables[:, :nblocks].long()
    shape = (blocks.shape[0], -1) + k_cache.shape[2:]
    return (k_cache[blocks].reshape(shape)[:, :ctx].to(dtype), v_cache[blocks].reshape(shape)[:, :ctx].to(dtype))


def _attend(q, k, v, scale, seq_lens, causal: bool):
    """q: [B, n, Hq, D] (the last n positions of each context), k/v: [B, N, Hk, D] -> [B, n, Hq, D], via
    torch's fused attention in fp32 (GQA without copying K or V)."""
    b, n = q.shape[:2]
    kv_len = k.shape[1]
    lens = seq_lens.to(q.device)
    k_pos = torch.arange(kv_len, device=q.device)
    mask = k_pos[None, None, :] < lens[:, None, None]                              # inside this context
    if causal:
        q_pos = lens[:, None] - n + torch.arange(n, device=q.device)[None, :]
        mask = mask & (k_pos[None, None, :] <= q_pos[:, :, None])
    o = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return o.transpose(1, 2).to(q.dtype)


def _decode_ref(q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """All single-token sequences at once, padded to the longest context (seq_len 0 rows give zeros)."""
    lens = md.seq_lens_cpu[:md.num_decodes]
    longest = max(lens)
    if longest == 0:
        return torch.zeros_like(q)
    k, v = _gather(k_cache, v_cache, md.block_tables[:md.num_decodes], longest)
    seq_lens = torch.tensor(lens)
    if min(lens) < longest:
        # Rows shorter than the longest read past their context: whatever is there (the pool is never
        # cleared, it may hold NaN bit patterns) must not reach the output through 0 * NaN.
        past = (torch.arange(longest)[None, :] >= seq_lens[:, None]).to(q.device)[:, :, None, None]
        k, v = k.masked_fill(past, 0.0), v.masked_fill(past, 0.0)
    out = _attend(q.unsqueeze(1), k, v, scale, seq_lens.clamp(min=1), causal=False)[:, 0]
    return torch.where((seq_lens > 0).to(q.device)[:, None, None], out, torch.zeros_like(out))


def paged_attention(q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    if use_triton(q):
        from engine.ops.triton import attention
        return attention.paged_attention(q, k_cache, v_cache, md, scale)
    return paged_attention_ref(q, k_cache, v_cache, md, scale)


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment [cu_seqlens[i], cu_seqlens[i+1]) (one image each).
    q, k, v: [N, H, D] -> [N, H, D]."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        p = (torch.matmul(qs, ks.transpose(-1, -2)) * scale).softmax(-1)
        out[start:end] = torch.matmul(p, vs).transpose(0, 1).to(q.dtype)
    return out


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
    if use_triton(q):
        from engine.ops.triton import varlen_attention as triton_varlen
        return triton_varlen.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, scale)
