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
    num_q_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    for i in range(md.num_seqs):
        start, end, ctx = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1], md.seq_lens_cpu[i]
        n = end - start
        if n == 0 or ctx == 0:
            continue
        nblocks = -(-ctx // block_size)
        blocks = md.block_tables[i, :nblocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1])[:ctx].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


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
        from engine.ops.triton import attention
        return attention.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, scale)
