"""Random inputs for the paged-attention tests (tests/test_ops_triton*.py, tests/test_kv_cache_fp8.py): a batch
of decodes and prefill chunks with q, random K/V caches behind shuffled block tables, and their metadata. Plain
torch, so that tests without Triton use it too."""
from __future__ import annotations

import torch

from engine.ops.attention import AttentionMetadata


def randn(gen, *shape, dtype=torch.float32, device="cpu", std=1.0):
    return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=dtype)


def make_batch(gen, decode_ctx, prefills, hq, hk, d, block_size, dtype, device, extra_tokens=0):
    """decode_ctx: context lengths of the decodes (0 = padding); prefills: (q_len, context) chunks whose
    queries are the last q_len tokens. Builds q, random caches behind shuffled block tables, and metadata."""
    seqs = [(1, c) for c in decode_ctx] + list(prefills)
    nblocks = [-(-c // block_size) for _, c in seqs]
    width = max(1, max(nblocks)) + 2  # spare columns: the kernels must not read past a sequence's blocks
    num_blocks = sum(nblocks) + 3
    k_cache = randn(gen, num_blocks + 1, block_size, hk, d, dtype=dtype, device=device)
    v_cache = randn(gen, num_blocks + 1, block_size, hk, d, dtype=dtype, device=device)
    # Table entries past a sequence's blocks point at a poison block (the last one): an unmasked read of it
    # would show in the output. (A valid id rather than garbage, because the reference may gather the tail.)
    k_cache[num_blocks] = 100.0
    v_cache[num_blocks] = 100.0
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.full((len(seqs), width), num_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblocks):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    qsl = [0]
    for q_len, _ in seqs:
        qsl.append(qsl[-1] + q_len)
    q = randn(gen, qsl[-1] + extra_tokens, hq, d, dtype=dtype, device=device, std=2.0)  # std 2: peakier softmax
    seq_lens = [c for _, c in seqs]
    md = AttentionMetadata(
        slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), num_decodes=len(decode_ctx), num_decode_tokens=len(decode_ctx),
        max_query_len=max(q_len for q_len, _ in seqs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return q, k_cache, v_cache, md
