"""CUDA graphs for decode steps: the whole decoder forward for a batch of single-token sequences is captured
once per batch size of a ladder, then replayed with the step's inputs copied into static buffers. A decode
step is ~300 kernel launches; replaying them as one graph removes the CPU launch cost that otherwise
dominates small batches. Padded rows have seq_len 0 and slot -1: they write no KV and read none.
"""
from __future__ import annotations

import time

import torch

from engine.logger import init_logger
from engine.ops import AttentionMetadata
from engine.ops.dispatch import triton_available

logger = init_logger(__name__)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond (vLLM-like), capped."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 mrope: bool, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.mrope = mrope
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, n) if mrope else (n,), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            num_decode_tokens=bs, max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[0] * bs)

    def _forward(self, bs: int) -> torch.Tensor:
        positions = self.positions[:, :bs] if self.mrope else self.positions[:bs]
        return self.model(self.input_ids[:bs], positions, self.kv_caches, self._metadata(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.mem_get_info()[0]
        for bs in reversed(self.sizes):      # largest first, so smaller graphs fit in its memory pool
            self._forward(bs)                # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        used = before - torch.cuda.mem_get_info()[0]
        logger.info("Captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s, using %.2f GiB",
                    len(self.sizes), self.max_bs, time.perf_counter() - start, used / 2**30)

    def can_run(self, inp) -> bool:
        md = inp.md
        return (inp.mm is None and md.max_query_len == 1 and md.num_decodes == md.num_seqs
                and md.num_seqs <= self.max_bs and md.block_tables.shape[1] <= self.max_blocks)

    def run(self, inp) -> torch.Tensor:
        n = inp.md.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        md = inp.md
        self.input_ids[:n].copy_(inp.input_ids, non_blocking=True)
        if self.mrope:
            self.positions[:, :n].copy_(inp.positions, non_blocking=True)
        else:
            self.positions[:n].copy_(inp.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].zero_()
        self.block_tables[:n, :md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


def enable_cuda_graphs(engine) -> None:
    if not triton_available():
        logger.warning("CUDA graphs need the Triton kernels (the torch references read host-side lengths); "
                       "running eagerly")
        return
    runner = CUDAGraphRunner(engine.model, engine.runner.kv_caches, engine.args.max_num_seqs,
                             engine.max_model_len, engine.args.block_size,
                             engine.model_config.mrope_section is not None, engine.device)
    runner.capture()
    engine.runner.graphs = runner
