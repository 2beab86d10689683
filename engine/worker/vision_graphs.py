"""CUDA graphs for the vision encoder.

Eagerly, one 1024x1024 image costs ~300 kernel launches (27 blocks of norms, GEMMs, rotary and attention); on the
H200 host that is 12-17 ms of CPU time against 13.6 ms of GPU time, so the GPU waited on the host. A graph replays
them in one launch.

A graph is captured the first time a shape is seen and kept (up to MAX_GRAPHS, oldest dropped). Its shape is the
patch count rounded up to a multiple of BUCKET_PATCHES, the number of attention segments (one per image frame), and
whether it pads. The padding rows form one more segment that attends only to itself, as the prefill graphs' dummy
sequence does, and their outputs are dropped. One image that fills its bucket exactly (a 1024x1024 one: 4096
patches) gets a graph without that segment, so its attention is one segment over all rows, which runs in cuDNN's
faster kernel on Hopper (engine/ops/triton/varlen_attention.py). Everything that depends on the images' grids
(positions, rotary, segment bounds) is computed on the host by the model's `prepare` and copied into the graph's
static inputs.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.logger import init_logger
from engine.sizing import MAX_GRAPH_PATCHES

logger = init_logger(__name__)

BUCKET_PATCHES = 512          # 128 LLM tokens: at most 511 padding rows (12% of a 1024x1024 image's 4096 patches)
MAX_GRAPHS = 8


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor          # static inputs
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: torch.Tensor
    embeds: torch.Tensor          # static outputs
    deepstack: torch.Tensor
    last: tuple = ()              # the (pos, cos, sin, cu_seqlens) tensors its static inputs were copied from


class VisionGraphs:
    def __init__(self, visual, device: torch.device):
        self.visual = visual
        self.device = device
        self.graphs: OrderedDict[tuple[int, int, bool], _Graph] = OrderedDict()   # (bucket, segments, padded)
        self.pool = torch.cuda.graph_pool_handle()     # graphs never run at once: they share their memory
        self.disabled = False
        self.merge = visual.merge ** 2
        self.dtype = visual.pos_embed.weight.dtype     # of the pixels and position rows the graphs take

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Same result as the model's encode_images(pixel_values, grid_thw), through a graph when the shape
        allows one."""
        pixel_values = pixel_values.to(self.dtype)
        pos, cos, sin, cu_seqlens, max_seqlen = self.visual.prepare(pixel_values, grid_thw)
        n, segments = pixel_values.shape[0], cu_seqlens.numel() - 1
        bucket = -(-n // BUCKET_PATCHES) * BUCKET_PATCHES
        if self.disabled or bucket > MAX_GRAPH_PATCHES:
            return self.visual.forward_prepared(pixel_values, pos, cos, sin, cu_seqlens, max_seqlen)
        g = self._graph(bucket, segments, padded=n < bucket or segments > 1)
        if g is None:
            return self.visual.forward_prepared(pixel_values, pos, cos, sin, cu_seqlens, max_seqlen)
        g.pixels[:n].copy_(pixel_values)
        grid_inputs = (pos, cos, sin, cu_seqlens)
        # The grid's tensors are cached by the model (same objects for the same image size): when this graph
        # last ran on these very tensors, its static copies still hold them (4 launches fewer per image).
        if len(g.last) != 4 or any(a is not b for a, b in zip(g.last, grid_inputs)):
            g.pos[:n].copy_(pos)
            g.cos[:n].copy_(cos)
            g.sin[:n].copy_(sin)
            g.cu_seqlens[:segments + 1].copy_(cu_seqlens)   # a padded graph's last entry (the bucket) closes its
            # padding segment
            g.last = grid_inputs
        g.graph.replay()
        rows = n // self.merge
        # Copies: the next replay overwrites the static outputs, and the encoder cache keeps these.
        return g.embeds[:rows].clone(), g.deepstack[:, :rows].clone()

    def _graph(self, bucket: int, segments: int, padded: bool) -> _Graph | None:
        key = (bucket, segments, padded)
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return g
        try:
            g = self._capture(bucket, segments, padded)
        except torch.cuda.OutOfMemoryError:
            self.disabled = True
            self.graphs.clear()
            logger.warning("vision encoder CUDA graphs disabled: out of memory capturing %d patches", bucket)
            return None
        self.graphs[key] = g
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return g

    def _capture(self, bucket: int, segments: int, padded: bool) -> _Graph:
        start = time.perf_counter()
        v, dev = self.visual, self.device
        half = v.config.head_dim // 2
        # Capture-time segments: real ones of one block each (their lengths do not matter: replays bring their
        # own bounds), the padding segment after them; a replay's max_seqlen is at most the bucket.
        bounds = [0, *range(self.merge, self.merge * (segments + 1), self.merge), bucket] if padded else [0, bucket]
        g = _Graph(graph=torch.cuda.CUDAGraph(),
                   pixels=torch.zeros(bucket, v.patch_dim, dtype=self.dtype, device=dev),
                   pos=torch.zeros(bucket, v.config.hidden_size, dtype=self.dtype, device=dev),
                   cos=torch.ones(bucket, half, dtype=torch.float32, device=dev),
                   sin=torch.zeros(bucket, half, dtype=torch.float32, device=dev),
                   cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=dev),
                   embeds=None, deepstack=None)
        inputs = (g.pixels, g.pos, g.cos, g.sin, g.cu_seqlens, bucket)
        v.forward_prepared(*inputs)            # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.embeds, g.deepstack = v.forward_prepared(*inputs)
        torch.cuda.synchronize()
        logger.info("Captured a vision encoder CUDA graph for %d patches in %d segment(s)%s in %.0f ms",
                    bucket, segments, "" if padded else " (no padding)", (time.perf_counter() - start) * 1e3)
        return g
