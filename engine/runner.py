"""The model runner: turns a SchedulerOutput into one flat varlen batch, runs the model over the paged KV cache
(eagerly, or by replaying a captured CUDA graph for decode steps and single-sequence prefill chunks), and samples
the next tokens on the device."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cache_engine import CacheEngine
from engine.config import ModelConfig
from engine.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.distributed.parallel_state import broadcast_tensor, get_tp_rank, get_tp_size
from engine.encoder_cache import EncoderCache, EncoderOutput
from engine.inputs.types import ProcessedPrompt
from engine.logger import init_logger
from engine.model.decoder import MultimodalEmbeds
from engine.ops import AttentionMetadata
from engine.sampler import SamplingMetadata, sample
from engine.sampling_params import SamplingParams
from engine.structured_output import Grammar, catch_up_grammars
from engine.transfer import to_device

logger = init_logger(__name__)


@dataclass(eq=False)
class CachedRequestState:
    """What the runner keeps about a request between steps (vLLM's name): its fixed data, and its output ids as
    they are read back (the penalties, bad words and the grammar matcher need them)."""
    request_id: str
    prompt: ProcessedPrompt
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    generator: torch.Generator | None
    grammar: Grammar | None = None                  # structured output; the runner is its only user
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    allowed_token_bits: torch.Tensor | None = None  # allowed_token_ids as a bitmask row, built on first use
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_new(cls, new: NewRequestData) -> "CachedRequestState":
        return cls(new.request_id, new.prompt, new.sampling_params, new.eos_token_ids, new.generator, new.grammar,
                   new.bad_words_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.prompt_token_ids)

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Rotary positions of tokens [start, end): [end-start] or, for M-RoPE, [3, end-start]."""
        mrope, n = self.prompt.mrope_positions, self.num_prompt_tokens
        if mrope is None:
            return torch.arange(start, end, dtype=torch.int64)
        parts = []
        if start < n:
            parts.append(mrope[:, start:min(end, n)])
        if end > n:
            gen = torch.arange(max(start, n), end, dtype=torch.int64)
            parts.append((gen + self.prompt.mrope_position_delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


@dataclass
class ModelInput:
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T], or [3, T] for M-RoPE
    md: AttentionMetadata
    logits_indices: torch.Tensor     # [S] rows of the batch whose logits are sampled, in sampled-row order
    sampled: list[CachedRequestState]  # the S requests that sample, in sampled-row order
    mm: MultimodalEmbeds | None
    # (request, its scheduled chunk, the chunk's first batch row) for chunks whose prompt tokens get scored
    prompt_logprob_chunks: list[tuple] = field(default_factory=list)


class InflightStep:
    """A launched step: its sampled token ids are on their way to a host buffer. result() waits only for this
    step's work (an event), never for a later step queued behind it."""

    def __init__(self, so: SchedulerOutput, token_ids: torch.Tensor | None = None, logprobs: list | None = None,
                 sampled: list[CachedRequestState] = (), prompt_logprobs: list[PromptLogprobs] = (),
                 to_host: bool = True):
        self.so = so
        self.token_ids = token_ids                # [S] on the device, row i for so.sampled[i] (pending inputs)
        self.prompt_logprobs = list(prompt_logprobs)   # chunks scored this step, on the device until result()
        self.logprobs = logprobs
        self._sampled = sampled                   # the runner's records of those S requests
        self._result: StepResult | None = None
        self._host = None
        self._event = None
        if to_host and token_ids is not None and token_ids.is_cuda:     # (a worker rank never reads them)
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> StepResult:
        """The step's output on the host (waits for this step only). Read once: later calls return the same, so
        the runner may read it early (catch_up_grammars) and the engine later."""
        if self._result is None:
            self._result = StepResult(prompt_logprobs={c.request_id: c.to_host() for c in self.prompt_logprobs})
            self.prompt_logprobs = []
            if self.token_ids is not None:
                if self._event is not None:
                    self._event.synchronize()
                    tokens = self._host.tolist()
                else:
                    tokens = self.token_ids.tolist()
                for state, token in zip(self._sampled, tokens):
                    state.output_token_ids.append(token)
                ids = [s.request_id for s in self.so.sampled]
                self._result.sampled = dict(zip(ids, tokens))
                self._result.logprobs = dict(zip(ids, self.logprobs)) if self.logprobs else {}
        return self._result


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)                        # request id -> token id
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)          # request id -> {token: logprob}
    # request id -> (first prompt position scored, one {token: logprob} per position from there)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


@dataclass
class PromptLogprobs:
    """prompt_logprobs of one prompt chunk, on the device until the step's result is read: row j is the
    distribution after token first + j - 1, scored at prompt token first + j."""
    request_id: str
    first: int                        # the first prompt position these rows score
    targets: list[int]                # the prompt tokens at those positions
    chosen: torch.Tensor              # [R] logprob of each prompt token
    top_values: torch.Tensor | None   # [R, k]
    top_ids: torch.Tensor | None

    @classmethod
    def compute(cls, model, hidden: torch.Tensor, req: CachedRequestState, s: ScheduledRequest,
                flat: int) -> "PromptLogprobs":
        start = s.num_computed_tokens
        end = min(s.end, req.num_prompt_tokens - 1)
        lp = model.compute_logits(hidden[flat:flat + end - start]).float().log_softmax(-1)
        targets = req.prompt_token_ids[start + 1:end + 1]
        k = req.sampling_params.prompt_logprobs
        top = lp.topk(k, dim=-1) if k else (None, None)
        chosen = lp.gather(-1, torch.tensor(targets, dtype=torch.int64, device=lp.device)[:, None]).squeeze(-1)
        return cls(req.request_id, start + 1, targets, chosen, *top)

    def to_host(self) -> tuple[int, list[dict[int, float]]]:
        """(first, one {token: logprob} per scored position, the prompt's own token first)."""
        tops = zip(self.top_ids.tolist(), self.top_values.tolist()) if self.top_ids is not None else None
        entries = []
        for target, value in zip(self.targets, self.chosen.tolist()):
            entry = {target: value}
            if tops is not None:
                ids, values = next(tops)
                for t, v in zip(ids, values):
                    entry.setdefault(t, v)
            entries.append(entry)
        return self.first, entries


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, cache: CacheEngine, block_size: int,
                 device: torch.device, encoder_cache_tokens: int = 16384):
        self.model = model
        self.config = config
        self.cache = cache
        self.kv_caches = cache.layer_caches()
        self.block_size = block_size
        self.device = device
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        self.requests: dict[str, CachedRequestState] = {}   # from its first step until it finishes
        self.graphs = None          # set by enable_cuda_graphs()
        self.vision_graphs = None   # likewise, for a multimodal model
        self._staging = None        # pinned host buffer for image uploads, reused (see _upload)
        self._staging_free = None   # event: the last upload from it has finished
        # Tensor parallelism: every rank runs this runner on its share of the model; rank 0 alone samples
        # (it owns the grammars, generators and penalties) and sends the token ids to the others.
        self.tp_size, self.is_driver = get_tp_size(), get_tp_rank() == 0

    # ---- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: InflightStep | None) -> InflightStep:
        """Queue step `so` on the device and return at once. Tokens still pending from `prev` (the step in
        flight) are read from its device output, so this does not wait for it."""
        self.update_states(so)
        self.cache.swap_out(so.blocks_to_swap_out)     # before any freed GPU block is written again
        self.cache.swap_in(so.blocks_to_swap_in)
        if not so.scheduled:
            return InflightStep(so)
        # The vision encoder first: its time on the device then covers the host's work of building the batch
        # below, instead of waiting for it.
        images = self.encode_images(so)
        inp = self.prepare_inputs(so, prev, images)
        if self.graphs is not None and self.graphs.can_run(inp):
            hidden = self.graphs.run(inp)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.md, inp.mm)
        prompt_lps = [PromptLogprobs.compute(self.model, hidden, req, s, row)
                      for req, s, row in inp.prompt_logprob_chunks]
        if not inp.sampled:
            return InflightStep(so, prompt_logprobs=prompt_lps)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        if not self.is_driver:
            return InflightStep(so, self._receive_token_ids(len(inp.sampled)), to_host=False)
        if any(state.grammar is not None for state in inp.sampled):
            catch_up_grammars(so, inp.sampled, prev)
        smd = SamplingMetadata.from_requests(inp.sampled, logits.shape[-1], self.device,
                                             [s.num_output_tokens for s in so.sampled])
        out = sample(logits, smd)
        if self.tp_size > 1:        # the next step's pending inputs must be the same ids on every rank
            broadcast_tensor(out.token_ids)
        return InflightStep(so, out.token_ids, out.logprobs, inp.sampled, prompt_lps)

    def _receive_token_ids(self, num_sampled: int) -> torch.Tensor:
        """A worker rank's copy of the ids rank 0 sampled this step (on the device, like rank 0's)."""
        token_ids = torch.empty(num_sampled, dtype=torch.int64, device=self.device)
        return broadcast_tensor(token_ids)

    def update_states(self, so: SchedulerOutput) -> None:
        """Forget the requests that finished, learn the new ones."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState.from_new(new)

    # ---- batch construction --------------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput, prev: InflightStep | None = None,
                       images: dict[str, EncoderOutput] | None = None) -> ModelInput:
        """The flat batch of step `so`; `images` are encode_images(so) when the caller ran it already."""
        if images is None:
            images = self.encode_images(so)
        # Decodes (one token) first: the attention op runs them through its decode kernel.
        entries = sorted(so.scheduled, key=lambda s: s.num_scheduled_tokens != 1)
        pending_flat, pending_rows = [], []      # batch rows whose input token is still on the device
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []    # 1-D; M-RoPE prefill chunks are patched in below
        slots: list[int] = []
        query_start, seq_lens, tables = [0], [], []
        logits_rows, chunks, scored = [0] * len(so.sampled), [], []
        mrope = self.config.mrope_section is not None
        for s in entries:
            req, n, start, end = self.requests[s.request_id], s.num_scheduled_tokens, s.num_computed_tokens, s.end
            blocks = s.block_ids
            ids.extend(s.token_ids)
            if s.pending_row is not None:         # its last input was sampled by the step in flight
                pending_flat.append(len(ids))
                pending_rows.append(s.pending_row)
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
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                scored.append((req, s, query_start[-1]))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if s.sample_row is not None:
                logits_rows[s.sample_row] = query_start[-1] - 1
        num_decodes = sum(1 for s in entries if s.num_scheduled_tokens == 1)
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
            sampled=[self.requests[s.request_id] for s in so.sampled], mm=self._multimodal_embeds(chunks, images),
            prompt_logprob_chunks=scored)

    # ---- vision --------------------------------------------------------------------------------------------
    def encode_images(self, so: SchedulerOutput) -> dict[str, EncoderOutput]:
        """Encoder outputs (content hash -> rows) of every image overlapping this step's chunks: from the
        encoder cache, the rest encoded together in one batch (launched on the device, not waited for)."""
        outputs: dict[str, EncoderOutput] = {}
        to_encode: dict[str, object] = {}                  # content hash -> one image with that content
        for s in so.scheduled if self.config.is_multimodal else ():
            start, end = s.num_computed_tokens, s.end
            for image in self.requests[s.request_id].prompt.images:
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
        wanted = [(image, flat, start, end) for req, flat, start, end in chunks for image in req.prompt.images
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
