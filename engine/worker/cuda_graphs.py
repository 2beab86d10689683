"""CUDA graphs: each step of ~400 kernel launches is replayed from a graph captured once, so the host pays one
launch instead of hundreds (on the device machine's CPU a Triton launch costs ~50 us, more than the kernel).

- Decode steps (every sequence has one query token): one graph per batch size of a ladder. Padded rows have
  seq_len 0 and slot -1: they write no KV and read none.
- Other steps of up to GRAPH_SEQ_SLOTS sequences (a prefill chunk, the time to first token of one prompt; a
  speculative verify step of a few requests; a chunk beside a few decodes): one graph per token-count bucket.
  Every sequence runs through the prefill attention kernel, in a fixed number of sequence slots with a dummy
  sequence for the bucket's unused rows (prefill_slots.py). A pool too small to spare the dummy's scratch blocks
  (small cards) gets the decode graphs alone.
  For a multimodal model the prefill graphs also take image rows, in the dense form (a row mask, embeds and
  deepstack rows per token; all-false / zero for text), so a chunk holding an image replays too.
All run on static buffers that each step's inputs are copied into.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.distributed.parallel_state import all_gather_object, get_tp_size
from engine.logger import init_logger
from engine.model.decoder import DenseMultimodalEmbeds, MultimodalEmbeds
from engine.ops import AttentionMetadata
from engine.ops.dispatch import triton_available
from engine.sizing import GRAPH_SEQ_SLOTS, PREFILL_BUCKETS, batch_size_ladder
from engine.worker.prefill_slots import PrefillSlots, block_slots
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.worker.worker import Worker

logger = init_logger(__name__)


def cuda_graphs_wanted(args, device: torch.device) -> bool:
    """Whether steps will replay CUDA graphs (unless the KV pool turns out too small for their scratch blocks)."""
    return device.type == "cuda" and not args.enforce_eager and triton_available()


def padded_decode_metadata(slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    """A decode graph's metadata: one query row per sequence, block tables as wide as the longest context. The
    host-side lengths are placeholders (the kernels read the device tensors, which each replay refills)."""
    bs = seq_lens.shape[0]
    return AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        num_decodes=bs, num_decode_tokens=bs, max_query_len=1, max_seq_len=block_tables.shape[1] * block_size,
        query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[0] * bs)


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 mrope: bool, device: torch.device, scratch_blocks: list[int]):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.mrope = mrope
        self.device = device
        n = max(self.max_bs, PREFILL_BUCKETS[-1])
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, n) if mrope else (n,), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        # decode
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        # prefill (prefill_slots.py): GRAPH_SEQ_SLOTS sequences and a dummy one
        self.prefill = bool(scratch_blocks)      # no scratch blocks: decode graphs only
        half = len(scratch_blocks) // 2
        self.dummy_blocks, self.check_blocks = scratch_blocks[:half], scratch_blocks[half:]
        self.slots = PrefillSlots(min(GRAPH_SEQ_SLOTS, max_num_seqs), max(self.max_blocks, len(scratch_blocks)),
                                  self.dummy_blocks, block_size, self.slot_mapping, device)
        self.check_slots = block_slots(self.check_blocks, block_size, device)
        self.mm = (DenseMultimodalEmbeds.zeros(model, PREFILL_BUCKETS[-1], device)
                   if model.config.is_multimodal and self.prefill else None)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        # EAGLE-3: the decoder writes its captured hidden states into one static buffer that every graph shares
        # (a buffer per graph would hold ~33k rows of 3 * hidden). Graphs record the capture layers set when they
        # were captured; a step under other layers runs eagerly.
        self.aux_layers = model.decoder.aux_hidden_state_layers
        if self.aux_layers:
            width = len(set(self.aux_layers)) * model.config.hidden_size
            model.decoder.aux_buffer = torch.empty(n, width, dtype=model.decoder.embed_tokens.weight.dtype,
                                                   device=device)
        self.pool = None

    def _positions(self, n: int) -> torch.Tensor:
        return self.positions[:, :n] if self.mrope else self.positions[:n]

    # ---- forward passes over the static buffers ------------------------------------------------------------
    def _decode_forward(self, bs: int) -> torch.Tensor:
        md = padded_decode_metadata(self.slot_mapping[:bs], self.query_start_loc[:bs + 1], self.seq_lens[:bs],
                                    self.block_tables[:bs], self.block_size)
        return self.model(self.input_ids[:bs], self._positions(bs), self.kv_caches, md)

    def _prefill_forward(self, bucket: int) -> torch.Tensor:
        md = self.slots.metadata(bucket)
        mm = None if self.mm is None else DenseMultimodalEmbeds(
            self.mm.mask[:bucket], self.mm.embeds[:bucket], self.mm.deepstack[:, :bucket])
        return self.model(self.input_ids[:bucket], self._positions(bucket), self.kv_caches, md, mm)

    def _set_fresh_prefills(self, lengths: list[int], bucket: int, blocks: torch.Tensor) -> None:
        """Real sequences of `lengths` fresh tokens each, their K/V in consecutive runs of `blocks` (capture and
        its check)."""
        starts, tables, slots, first = [0], [], [], 0
        width = -(-max(lengths) // self.block_size)
        for length in lengths:
            starts.append(starts[-1] + length)
            tables.append(blocks[first:first + width])
            slots.append(self.check_slots[first * self.block_size:first * self.block_size + length])
            first += -(-length // self.block_size)
        self.slots.set(bucket, to_device(starts, torch.int32, self.device),
                       to_device(lengths, torch.int32, self.device), torch.stack(tables), torch.cat(slots))

    # ---- capture -------------------------------------------------------------------------------------------
    def _capture(self, key: tuple[str, int], forward) -> None:
        forward()                        # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = forward()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.mem_get_info()[0]
        check_table = torch.tensor(self.check_blocks, dtype=torch.int32, device=self.device)
        for bucket in reversed(PREFILL_BUCKETS if self.prefill else ()):   # largest first: the rest fit its pool
            self._set_fresh_prefills([bucket // 2], bucket, check_table)
            self._capture(("prefill", bucket), lambda b=bucket: self._prefill_forward(b))
        for bs in reversed(self.sizes):
            self._capture(("decode", bs), lambda b=bs: self._decode_forward(b))
        torch.cuda.synchronize()
        if self.prefill:
            self._check_prefill(check_table)
            prefill = f"{sum(1 for k in self.graphs if k[0] == 'prefill')} prefill sizes (up to " \
                      f"{PREFILL_BUCKETS[-1]} tokens of up to {self.slots.seq_slots} sequences)"
        else:
            prefill = "no prefill sizes (the KV pool cannot spare their scratch blocks: prefill chunks run eagerly)"
        logger.info("Captured CUDA graphs for %d decode batch sizes (1..%d) and %s in %.1f s, using %.2f GiB",
                    len(self.sizes), self.max_bs, prefill, time.perf_counter() - start,
                    (before - torch.cuda.mem_get_info()[0]) / 2**30)

    def _check_prefill(self, check_table: torch.Tensor) -> None:
        """Replay one prefill graph and run the same padded batch (two sequences where the graphs hold several)
        eagerly (same shapes, so the same kernels):
        they must agree. On a mismatch, drop the prefill graphs rather than serve wrong answers."""
        n, bucket = 40, 64
        # The same ids on every tensor-parallel rank: the check's forward passes are collectives.
        ids = torch.randint(0, self.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        self.input_ids[:n].copy_(ids)
        # Two fresh sequences where the graphs hold several (a verify step's shape), else one.
        lengths = [24, n - 24] if self.slots.seq_slots > 1 else [n]
        positions = torch.cat([torch.arange(length) for length in lengths]).to(self.device)
        self._positions(n).copy_(positions.expand(3, -1) if self.mrope else positions)
        self._set_fresh_prefills(lengths, bucket, check_table)
        eager = self._prefill_forward(bucket)[:n].float()
        self.graphs[("prefill", bucket)].replay()
        graph = self.outputs[("prefill", bucket)][:n].float()
        err = ((graph - eager).norm() / eager.norm().clamp(min=1e-6)).item()
        # Every rank keeps or drops the prefill graphs alike: a replay on one rank pairs with a replay on the others.
        if not all(all_gather_object(err < 1e-3)):
            for key in [k for k in self.graphs if k[0] == "prefill"]:
                del self.graphs[key]
            logger.warning("prefill CUDA graphs disabled: replay differs from eager by %.3g (relative)", err)

    # ---- replay --------------------------------------------------------------------------------------------
    def can_run(self, inp) -> bool:
        md = inp.md
        if md.block_tables.shape[1] > self.max_blocks:
            return False
        if self.model.decoder.aux_hidden_state_layers != self.aux_layers:
            return False
        if md.max_query_len == 1 and md.num_decodes == md.num_seqs and inp.mm is None:
            return md.num_seqs <= self.max_bs
        n = inp.input_ids.shape[0]
        return md.num_seqs <= self.slots.seq_slots and ("prefill", _bucket(n)) in self.graphs

    def run(self, inp) -> torch.Tensor:
        md = inp.md
        n = inp.input_ids.shape[0]
        self.input_ids[:n].copy_(inp.input_ids, non_blocking=True)
        self._positions(n).copy_(inp.positions, non_blocking=True)
        if md.max_query_len == 1 and md.num_decodes == md.num_seqs:
            bs = next(s for s in self.sizes if s >= n)
            self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
            self.seq_lens[n:bs].zero_()
            self.block_tables[:n, :md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
            key = ("decode", bs)
        else:
            bucket = _bucket(n)
            self.slots.set(bucket, md.query_start_loc, md.seq_lens, md.block_tables, md.slot_mapping)
            key = ("prefill", bucket)
        if inp.mm is None:
            self.graphs[key].replay()
        else:
            self._replay_with_images(key, inp.mm)
        if self.aux_layers:
            self.model.decoder.aux_hidden_states = self.model.decoder.aux_buffer[:n]
        return self.outputs[key][:n]

    def _replay_with_images(self, key, mm: MultimodalEmbeds) -> None:
        """Scatter the image rows into the dense buffers, replay, then restore the all-text state (mask false,
        deepstack zero) that every other replay relies on. All of it is queued on the stream, in order."""
        self.mm.scatter_(mm)
        self.graphs[key].replay()
        self.mm.clear_(mm)


def _bucket(n: int) -> int:
    """The smallest prefill bucket with room for n tokens plus at least one dummy row (0 if none)."""
    return next((b for b in PREFILL_BUCKETS if b > n), 0)


def enable_cuda_graphs(worker: Worker) -> None:
    """Capture the decoder's graphs for one rank's `worker` (engine/worker/worker.py). Every rank
    captures the same graphs, the collectives inside them included."""
    if not triton_available():
        logger.warning("CUDA graphs need the Triton kernels (the torch references read host-side lengths); "
                       "running eagerly")
        return
    runner = CUDAGraphRunner(worker.model, worker.model_runner.kv_caches, worker.args.max_num_seqs,
                             worker.max_model_len, worker.args.block_size,
                             worker.model_config.mrope_section is not None, worker.device,
                             worker.scratch_blocks)
    try:
        runner.capture()
    except torch.cuda.OutOfMemoryError:
        # Under tensor parallelism the other ranks may be inside a collective of the capture: this rank's error
        # ends the engine (a rank that dies stops all) rather than leaving the ranks with different graphs.
        if worker.gpu_memory_limit is None or get_tp_size() > 1:
            raise
        runner = None
    if runner is None:
        # The pools outgrew the share the limit set aside for them: eager steps fit the profiled budget.
        torch.cuda.empty_cache()
        logger.warning("CUDA graphs off: capturing them ran out of memory under --gpu-memory-limit; eager steps")
        return
    worker.model_runner.graphs = runner
    if worker.model_config.is_multimodal:
        from engine.worker.vision_graphs import VisionGraphs
        worker.model_runner.vision_graphs = VisionGraphs(worker.model.visual, worker.device)
