"""The model runner: turns a SchedulerOutput into one flat varlen batch, runs the model over the paged KV cache
(eagerly, or by replaying a captured CUDA graph for decode-only steps), and samples the next tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache_engine import CacheEngine
from engine.config import ModelConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.encoder_cache import EncoderCache, EncoderOutput
from engine.model.decoder import MultimodalEmbeds
from engine.ops import AttentionMetadata
from engine.sampler import SamplingMetadata, sample


@dataclass
class ModelInput:
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T], or [3, T] for M-RoPE
    md: AttentionMetadata
    logits_indices: torch.Tensor     # [S] rows of the batch whose logits are sampled
    sample_requests: list[Request]   # the S requests, in logits order
    mm: MultimodalEmbeds | None


@dataclass
class StepResult:
    sampled: dict[str, int]                              # request id -> new token
    logprobs: dict[str, dict[int, float]]                # request id -> {token: logprob} (when asked)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, cache: CacheEngine, kv: KVCacheManager,
                 block_size: int, device: torch.device, encoder_cache_tokens: int = 16384):
        self.model = model
        self.config = config
        self.cache = cache
        self.kv_caches = cache.layer_caches()
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        self.graphs = None   # set by enable_cuda_graphs()

    # ---- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> StepResult:
        self.cache.swap_out(so.blocks_to_swap_out)     # before any freed GPU block is written again
        self.cache.swap_in(so.blocks_to_swap_in)
        if not so.scheduled:
            return StepResult({}, {})
        inp = self.prepare_inputs(so)
        if self.graphs is not None and self.graphs.can_run(inp):
            hidden = self.graphs.run(inp)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.md, inp.mm)
        if not inp.sample_requests:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        smd = SamplingMetadata.from_requests(inp.sample_requests, logits.shape[-1], self.device)
        out = sample(logits, smd)
        ids = [r.request_id for r in inp.sample_requests]
        sampled = dict(zip(ids, out.token_ids.tolist()))
        logprobs = dict(zip(ids, out.logprobs)) if out.logprobs else {}
        return StepResult(sampled, logprobs)

    # ---- batch construction --------------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> ModelInput:
        # Decodes (one token) first: the attention op runs them through its decode kernel.
        reqs = sorted(so.scheduled, key=lambda r: so.num_scheduled_tokens[r.request_id] != 1)
        bs = self.block_size
        ids: list[int] = []
        positions: list = []
        slots: list[int] = []
        query_start, seq_lens, tables = [0], [], []
        logits_rows, sample_reqs, chunks = [], [], []
        mrope = self.config.mrope_section is not None
        for req in reqs:
            n = so.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            end = start + n
            blocks = self.kv.block_ids(req.request_id)
            ids.extend(req.all_token_ids[start:end])
            positions.append(req.positions(start, end) if mrope else range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append((req, query_start[-1], start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if end == req.num_tokens:
                logits_rows.append(query_start[-1] - 1)
                sample_reqs.append(req)
        num_decodes = sum(1 for r in reqs if so.num_scheduled_tokens[r.request_id] == 1)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        if mrope:
            pos = torch.cat(positions, dim=1)
        else:
            pos = torch.tensor([p for r in positions for p in r], dtype=torch.int64)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            max_query_len=max(so.num_scheduled_tokens.values()), max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=pos.to(dev, non_blocking=True), md=md,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
            sample_requests=sample_reqs, mm=self._multimodal_embeds(chunks))

    # ---- vision --------------------------------------------------------------------------------------------
    def _multimodal_embeds(self, chunks) -> MultimodalEmbeds | None:
        """Vision rows for every image placeholder inside this step's chunks. Images not in the encoder cache
        are encoded together in one batch; a chunk that starts or ends inside an image takes its slice."""
        wanted = [(req, image, flat, start, end) for req, flat, start, end in chunks for image in req.images
                  if image.offset < end and image.end > start]
        if not wanted:
            return None
        outputs: dict[str, EncoderOutput] = {}
        to_encode = []
        for _, image, *_ in wanted:
            key = image.content_hash
            if key in outputs or any(key == i.content_hash for i in to_encode):
                continue
            hit = self.encoder_cache.get(key)
            if hit is not None:
                outputs[key] = hit
            else:
                to_encode.append(image)
        if to_encode:
            outputs.update(self._encode(to_encode))
        indices, rows, deep = [], [], []
        for _, image, flat, start, end in wanted:
            lo, hi = max(start, image.offset), min(end, image.end)
            enc = outputs[image.content_hash]
            rows.append(enc.embeds[lo - image.offset: hi - image.offset])
            if enc.deepstack is not None:
                deep.append(enc.deepstack[:, lo - image.offset: hi - image.offset])
            indices.append(torch.arange(flat + lo - start, flat + hi - start))
        return MultimodalEmbeds(token_indices=torch.cat(indices).to(self.device), embeds=torch.cat(rows),
                                deepstack=torch.cat(deep, dim=1) if deep else None)

    def _encode(self, images) -> dict[str, EncoderOutput]:
        pixels = torch.cat([i.pixel_values for i in images]).to(self.device, non_blocking=True)
        grid = torch.tensor([i.grid_thw for i in images], dtype=torch.int64)
        embeds, deepstack = self.model.encode_images(pixels, grid)
        out, row = {}, 0
        keep = {i.content_hash for i in images}
        for image in images:
            n = image.length
            ds = deepstack[:, row:row + n] if deepstack is not None and deepstack.numel() else None
            out[image.content_hash] = EncoderOutput(embeds[row:row + n], ds)
            self.encoder_cache.put(image.content_hash, out[image.content_hash], keep)
            row += n
        return out
