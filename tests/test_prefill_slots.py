"""The prefill CUDA graphs' sequence slots (engine/worker/prefill_slots.py): a step of a few sequences copied into a
graph's buffers is the same attention problem. The buffers are checked here on the CPU; the attention over them runs
the Triton kernel (in the interpreter, or compiled on a GPU) against the reference on the step as it is, so a graph
replaying the padded step gives the step's rows."""
from __future__ import annotations

import pytest
import torch

from engine.ops.attention import paged_attention_ref
from engine.worker.prefill_slots import PrefillSlots
from paged_batches import make_batch

SLOTS, BUCKET, BLOCK = 4, 32, 4


def fill(md, n: int, device: str, width: int) -> PrefillSlots:
    dummy_blocks = list(range(100, 100 + BUCKET // BLOCK))
    slots = PrefillSlots(SLOTS, width, dummy_blocks, BLOCK, torch.full((BUCKET,), -1, dtype=torch.int64,
                                                                          device=device), torch.device(device))
    slots.set(BUCKET, md.query_start_loc, md.seq_lens, md.block_tables, md.slot_mapping[:n])
    return slots


def test_a_step_takes_the_first_slots_and_the_dummy_the_bucket_rows_after_it():
    """Two decodes and a chunk of 5 (7 query rows): slots 0-2 hold them, slot 3 is empty (no rows, no context), the
    dummy owns rows 7..31 with its K/V in the scratch blocks."""
    q, _, _, md = make_batch(torch.Generator().manual_seed(0), [9, 3], [(5, 12)], 4, 2, 16, BLOCK, torch.float32,
                             "cpu")
    md.slot_mapping = torch.arange(7)
    slots = fill(md, 7, "cpu", width=16)
    assert slots.query_start_loc.tolist() == [0, 1, 2, 7, 7, 32]
    assert slots.seq_lens.tolist() == [9, 3, 12, 0, 25]
    assert torch.equal(slots.block_tables[:3, :md.block_tables.shape[1]], md.block_tables)
    assert slots.block_tables[SLOTS, :BUCKET // BLOCK].tolist() == list(range(100, 108))
    assert slots.slot_mapping[:7].tolist() == list(range(7))
    assert slots.slot_mapping[7:].tolist() == [400 + i for i in range(25)]       # block 100's first slot is 400
    md_graph = slots.metadata(BUCKET)
    assert md_graph.num_seqs == SLOTS + 1 and md_graph.num_decodes == 0 and md_graph.query_start_loc_cpu[-1] == BUCKET


def test_a_smaller_step_after_a_larger_one_leaves_no_stale_sequence():
    gen = torch.Generator().manual_seed(1)
    _, _, _, big = make_batch(gen, [5, 6, 7], [(3, 9)], 4, 2, 16, BLOCK, torch.float32, "cpu")
    slots = fill(big, 6, "cpu", width=16)
    _, _, _, small = make_batch(gen, [], [(4, 10)], 4, 2, 16, BLOCK, torch.float32, "cpu")
    slots.set(BUCKET, small.query_start_loc, small.seq_lens, small.block_tables, small.slot_mapping[:4])
    assert slots.query_start_loc.tolist() == [0, 4, 4, 4, 4, 32]
    assert slots.seq_lens.tolist() == [10, 0, 0, 0, 28]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.triton_interpret),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs CUDA")])])
def test_the_padded_step_attends_as_the_step(device):
    """Decodes, a verify-like chunk and a prefill chunk in a graph's slots: the Triton kernel over the padded
    batch (every sequence through the prefill kernel, an empty slot, the dummy's rows) gives the step's rows as the
    reference computes them on the step itself."""
    pytest.importorskip("triton")
    from engine.ops.triton.attention import paged_attention
    gen = torch.Generator().manual_seed(2)
    hq, hk, d = 4, 2, 32
    q, k_cache, v_cache, md = make_batch(gen, [7, 40], [(5, 23)], hq, hk, d, BLOCK, torch.float32, device)
    n = q.shape[0]
    # The dummy's blocks (100..107) past the pool's: grow the caches to hold them.
    extra = 108 - k_cache.shape[0]
    k_cache = torch.cat([k_cache, torch.randn(extra, *k_cache.shape[1:], generator=gen).to(device)])
    v_cache = torch.cat([v_cache, torch.randn(extra, *v_cache.shape[1:], generator=gen).to(device)])
    md.slot_mapping = md.slot_mapping[:n]
    slots = fill(md, n, device, width=max(16, md.block_tables.shape[1]))
    q_padded = torch.cat([q, torch.randn(BUCKET - n, hq, d, generator=gen).to(device)])
    got = paged_attention(q_padded, k_cache, v_cache, slots.metadata(BUCKET), d ** -0.5)[:n]
    want = paged_attention_ref(q, k_cache, v_cache, md, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
