"""The model runner: turns a SchedulerOutput into one flat varlen batch, runs the model over the paged KV cache
(eagerly, or by replaying a captured CUDA graph for decode steps and single-sequence prefill chunks), and samples
the next tokens on the device."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cache_engine import CacheEngine
from engine.config import ModelConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.encoder_cache import EncoderCache, EncoderOutput
from engine.logger import init_logger
from engine.model.decoder import MultimodalEmbeds
from engine.ops import AttentionMetadata
from engine.sampler import SamplingMetadata, sample
from engine.structured_output import catch_up_grammars
from engine.transfer import to_device

logger = init_logger(__name__)


@dataclass
class ModelInput:
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T], or [3, T] for M-RoPE
    md: AttentionMetadata
    logits_indices: torch.Tensor     # [S] rows of the batch whose logits are sampled
    sample_requests: list[Request]   # the S requests, in logits order
    mm: MultimodalEmbeds | None
    flat_starts: dict[str, int] = field(default_factory=dict)   # request id -> its chunk's first batch row


class InflightStep:
    """A launched step: its sampled token ids are on their way to a host buffer. result() waits only for this
    step's work (an event), never for a later step queued behind it."""

    def __init__(self, so: SchedulerOutput, requests: list[Request], token_ids: torch.Tensor | None,
                 logprobs: list | None, prompt_logprobs: list[PromptLogprobs] | None = None):
        self.so = so
        self.prompt_logprobs = prompt_logprobs or []
        self.requests = requests                  # the requests that sampled, in row order
        self.rows = {r.request_id: i for i, r in enumerate(requests)}
        self.token_ids = token_ids                # [S] on the device (the next step's pending inputs)
        self.logprobs = logprobs
        self._host = None
        self._event = None
        if token_ids is not None and token_ids.is_cuda:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> tuple[dict[str, int], dict[str, dict[int, float]]]:
        for chunk in self.prompt_logprobs:
            chunk.store()
        self.prompt_logprobs = []
        if self.token_ids is None:
            return {}, {}
        if self._event is not None:
            self._event.synchronize()
            tokens = self._host.tolist()
        else:
            tokens = self.token_ids.tolist()
        ids = [r.request_id for r in self.requests]
        return dict(zip(ids, tokens)), (dict(zip(ids, self.logprobs)) if self.logprobs else {})


@dataclass
class PromptLogprobs:
    """prompt_logprobs of one prompt chunk, on the device until the step's result is read: row j is the
    distribution after token first + j - 1, scored at prompt token first + j."""
    request: Request
    first: int                        # the first prompt position these rows score
    chosen: torch.Tensor              # [R] logprob of each prompt token
    top_values: torch.Tensor | None   # [R, k]
    top_ids: torch.Tensor | None

    @classmethod
    def compute(cls, model, hidden: torch.Tensor, req: Request, so: SchedulerOutput, flat: int) -> "PromptLogprobs":
        start = so.chunk_start[req.request_id]
        end = min(start + so.num_scheduled_tokens[req.request_id], req.num_prompt_tokens - 1)
        lp = model.compute_logits(hidden[flat:flat + end - start]).float().log_softmax(-1)
        targets = torch.tensor(req.prompt_token_ids[start + 1:end + 1], dtype=torch.int64, device=lp.device)
        k = req.sampling_params.prompt_logprobs
        top = lp.topk(k, dim=-1) if k else (None, None)
        return cls(req, start + 1, lp.gather(-1, targets[:, None]).squeeze(-1), *top)

    def store(self) -> None:
        """Into the request's prompt_logprobs ({token: logprob}, the prompt's own token first; None at position
        0, which nothing predicts). A prompt computed again after a preemption writes the same places."""
        req = self.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        tops = zip(self.top_ids.tolist(), self.top_values.tolist()) if self.top_ids is not None else None
        for j, value in enumerate(self.chosen.tolist()):
            pos = self.first + j
            entry = {req.prompt_token_ids[pos]: value}
            if tops is not None:
                ids, values = next(tops)
                for t, v in zip(ids, values):
                    entry.setdefault(t, v)
            req.prompt_logprobs[pos] = entry


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
        self.graphs = None          # set by enable_cuda_graphs()
        self.vision_graphs = None   # likewise, for a multimodal model
        self._staging = None        # pinned host buffer for image uploads, reused (see _upload)
        self._staging_free = None   # event: the last upload from it has finished

    # ---- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: InflightStep | None) -> InflightStep:
        """Queue step `so` on the device and return at once. Tokens still pending from `prev` (the step in
        flight) are read from its device output, so this does not wait for it."""
        self.cache.swap_out(so.blocks_to_swap_out)     # before any freed GPU block is written again
        self.cache.swap_in(so.blocks_to_swap_in)
        if not so.scheduled:
            return InflightStep(so, [], None, None)
        # The vision encoder first: its time on the device then covers the host's work of building the batch
        # below, instead of waiting for it.
        images = self.encode_images(so)
        inp = self.prepare_inputs(so, prev, images)
        if self.graphs is not None and self.graphs.can_run(inp):
            hidden = self.graphs.run(inp)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.md, inp.mm)
        prompt_lps = [PromptLogprobs.compute(self.model, hidden, r, so, inp.flat_starts[r.request_id])
                      for r in so.scheduled if r.sampling_params.prompt_logprobs is not None
                      and so.chunk_start[r.request_id] < r.num_prompt_tokens - 1]
        if not inp.sample_requests:
            return InflightStep(so, [], None, None, prompt_lps)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        catch_up_grammars(inp.sample_requests, prev)
        smd = SamplingMetadata.from_requests(inp.sample_requests, logits.shape[-1], self.device)
        out = sample(logits, smd)
        return InflightStep(so, inp.sample_requests, out.token_ids, out.logprobs, prompt_lps)

    # ---- batch construction --------------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput, prev: InflightStep | None = None,
                       images: dict[str, EncoderOutput] | None = None) -> ModelInput:
        """The flat batch of step `so`; `images` are encode_images(so) when the caller ran it already."""
        if images is None:
            images = self.encode_images(so)
        # Decodes (one token) first: the attention op runs them through its decode kernel.
        reqs = sorted(so.scheduled, key=lambda r: so.num_scheduled_tokens[r.request_id] != 1)
        pending_flat, pending_rows = [], []      # batch rows whose input token is still on the device
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []    # 1-D; M-RoPE prefill chunks are patched in below
        slots: list[int] = []
        query_start, seq_lens, tables = [0], [], []
        logits_rows, sample_reqs, chunks, flat_starts = [], [], [], {}
        mrope = self.config.mrope_section is not None
        for req in reqs:
            n = so.num_scheduled_tokens[req.request_id]
            start = so.chunk_start[req.request_id]
            end = start + n
            blocks = self.kv.block_ids(req.request_id)
            ids.extend(req.all_token_ids[start:end])
            if end > req.num_tokens:              # its last input was sampled by the step in flight
                pending_flat.append(len(ids))
                pending_rows.append(prev.rows[req.request_id])
                ids.append(0)
            if mrope and start < req.num_prompt_tokens:
                positions.extend(range(n))        # placeholder: the prompt's 3-axis positions are copied below
            elif mrope:   # generated tokens: the same position n + delta on all three axes
                delta = req.prompt.mrope_position_delta
                positions.extend(range(start + delta, end + delta))
            else:
                positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append((req, query_start[-1], start, end))
            flat_starts[req.request_id] = query_start[-1]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if req.request_id in so.sampling:
                logits_rows.append(query_start[-1] - 1)
                sample_reqs.append(req)
        num_decodes = sum(1 for r in reqs if so.num_scheduled_tokens[r.request_id] == 1)
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        table = torch.from_numpy(table)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64)
        if mrope:
            pos = pos.repeat(3, 1)
            for req, flat, start, end in chunks:
                if start < req.num_prompt_tokens:
                    pos[:, flat:flat + end - start] = req.positions(start, end)
        md = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            query_start_loc=to_device(query_start, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            block_tables=to_device(table, torch.int32, dev),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            max_query_len=max(so.num_scheduled_tokens.values()), max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
        input_ids = to_device(ids, torch.int64, dev)
        if pending_flat:
            rows = to_device(pending_rows, torch.int64, dev)
            input_ids[to_device(pending_flat, torch.int64, dev)] = prev.token_ids[rows]
        return ModelInput(
            input_ids=input_ids,
            positions=to_device(pos, torch.int64, dev), md=md,
            logits_indices=to_device(logits_rows, torch.int64, dev),
            sample_requests=sample_reqs, mm=self._multimodal_embeds(chunks, images), flat_starts=flat_starts)

    # ---- vision --------------------------------------------------------------------------------------------
    def encode_images(self, so: SchedulerOutput) -> dict[str, EncoderOutput]:
        """Encoder outputs (content hash -> rows) of every image overlapping this step's chunks: from the
        encoder cache, the rest encoded together in one batch (launched on the device, not waited for)."""
        outputs: dict[str, EncoderOutput] = {}
        to_encode: dict[str, object] = {}                  # content hash -> one image with that content
        for req in so.scheduled if self.config.is_multimodal else ():
            if not req.images:
                continue
            start = so.chunk_start[req.request_id]
            end = start + so.num_scheduled_tokens[req.request_id]
            for image in req.images:
                key = image.content_hash
                if image.offset >= end or image.end <= start or key in outputs or key in to_encode:
                    continue
                hit = self.encoder_cache.get(key)
                if hit is not None:
                    outputs[key] = hit
                else:
                    to_encode[key] = image
        if to_encode:
            outputs.update(self._encode(list(to_encode.values())))
        return outputs

    def _multimodal_embeds(self, chunks, encoded: dict[str, EncoderOutput]) -> MultimodalEmbeds | None:
        """Vision rows for every image placeholder inside this step's chunks (`encoded`: encode_images' result);
        a chunk that starts or ends inside an image takes its slice."""
        if not encoded:          # no image in this step (every text step): skip the scan over its requests
            return None
        wanted = [(image, flat, start, end) for req, flat, start, end in chunks for image in req.images
                  if image.offset < end and image.end > start]
        if not wanted:
            return None
        indices, rows, deep = [], [], []
        for image, flat, start, end in wanted:
            lo, hi = max(start, image.offset), min(end, image.end)
            enc = encoded[image.content_hash]
            rows.append(enc.embeds[lo - image.offset: hi - image.offset])
            if enc.deepstack is not None:
                deep.append(enc.deepstack[:, lo - image.offset: hi - image.offset])
            indices.append(torch.arange(flat + lo - start, flat + hi - start))
        return MultimodalEmbeds(token_indices=to_device(torch.cat(indices), torch.int64, self.device),
                                embeds=torch.cat(rows),
                                deepstack=torch.cat(deep, dim=1) if deep else None)

    def _encode(self, images) -> dict[str, EncoderOutput]:
        dtype = self.model.visual.pos_embed.weight.dtype     # the pixels come out in the encoder's dtype
        parts = [i.to_pixels(raw, dtype) for i, raw in zip(images, self._upload([i.raw for i in images]))]
        pixels = parts[0] if len(parts) == 1 else torch.cat(parts)   # one image: no copy
        grid = torch.tensor([i.grid_thw for i in images], dtype=torch.int64)
        encode = self.model.encode_images if self.vision_graphs is None else self.vision_graphs.encode
        embeds, deepstack = encode(pixels, grid)
        out, row = {}, 0
        keep = {i.content_hash for i in images}
        for image in images:
            n = image.length
            ds = deepstack[:, row:row + n] if deepstack is not None and deepstack.numel() else None
            out[image.content_hash] = EncoderOutput(embeds[row:row + n], ds)
            self.encoder_cache.put(image.content_hash, out[image.content_hash], keep)
            row += n
        return out

    def _upload(self, raws: list[torch.Tensor]) -> list[torch.Tensor]:
        """The images' uint8 pixels on the device. On a GPU they go through one pinned buffer kept for the
        purpose: pinning a fresh 3 MB buffer per image (what to_device does) cost ~4 ms of host time."""
        if self.device.type != "cuda":
            return [r.to(self.device) for r in raws]
        total = sum(r.numel() for r in raws)
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        elif self._staging_free is not None:
            self._staging_free.synchronize()       # the previous upload has left the buffer
        out, at = [], 0
        for r in raws:
            chunk = self._staging[at:at + r.numel()]
            chunk.copy_(r.reshape(-1))
            out.append(chunk.to(self.device, non_blocking=True).view(r.shape))
            at += r.numel()
        self._staging_free = torch.cuda.Event()
        self._staging_free.record()
        return out
