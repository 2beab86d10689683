"""The model runner: turns a SchedulerOutput into one flat varlen batch, runs the model over the paged KV cache
(eagerly, or by replaying a captured CUDA graph for decode steps and for other steps of a few sequences: prefill
chunks, verify steps), and samples the next tokens on the device."""
from __future__ import annotations

import numpy as np
import torch

from engine.config import ModelConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.distributed.parallel_state import broadcast_tensor, get_tp_rank, get_tp_size
from engine.logger import init_logger
from engine.model.decoder import MultimodalEmbeds
from engine.ops import AttentionMetadata
from engine.sampler import SamplingMetadata, sample
from engine.spec_decode.eagle3_proposer import DraftFeed
from engine.spec_decode.rejection_sampler import verify
from engine.sizing import MAX_GRAPH_PATCHES
from engine.structured_output import Grammar, catch_up_grammars
from engine.transfer import to_device
from engine.worker.cache_engine import CacheEngine
from engine.worker.encoder_cache import EncoderCache, EncoderOutput
from engine.worker.inflight import InflightStep, PromptLogprobs
from engine.worker.input_batch import CachedRequestState, InputBatch, ModelInput

logger = init_logger(__name__)


class ModelRunner:
    """One rank's runner. `image_processor` turns an image's uint8 pixels into the vision encoder's input;
    `grammars` is rank 0's registry of structured-output matchers by request id, filled by the engine core as
    requests arrive and emptied here as each is first scheduled (None on other ranks)."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, cache: CacheEngine, block_size: int,
                 device: torch.device, encoder_cache_tokens: int = 16384, image_processor=None,
                 grammars: dict[str, Grammar] | None = None, drafter=None):
        self.model = model
        self.config = config
        self.cache = cache
        self.kv_caches = cache.layer_caches()
        self.block_size = block_size
        self.device = device
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        self.image_processor = image_processor
        self.grammars = grammars
        # EAGLE-3 (rank 0): drafts from this step's captured hidden states once its tokens are known; every step
        # is then read before the next is scheduled (the scheduler knows), so the drafter sees every position.
        self.drafter = drafter
        self.requests: dict[str, CachedRequestState] = {}   # from its first step until it finishes
        self.input_batch = InputBatch()
        self._last: InflightStep | None = None   # the step launched last: its device ids feed pending inputs
        self.graphs = None          # set by enable_cuda_graphs()
        self.vision_graphs = None   # likewise, for a multimodal model
        self._staging = None        # pinned host buffer for image uploads, reused (see _upload)
        self._staging_free = None   # event: the last upload from it has finished
        # Tensor parallelism: every rank runs this runner on its share of the model; rank 0 alone samples
        # (it owns the grammars, generators and penalties) and sends the token ids to the others.
        self.tp_size, self.is_driver = get_tp_size(), get_tp_rank() == 0

    # ---- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> InflightStep:
        """Queue step `so` on the device and return at once. Tokens still pending from the step launched before
        (in flight) are read from its device output, so this does not wait for it."""
        prev = self._last
        self.update_states(so)
        self.cache.swap_out(so.blocks_to_swap_out)     # before any freed GPU block is written again
        self.cache.swap_in(so.blocks_to_swap_in)
        self._last = step = self._launch(so, prev)
        return step

    def _launch(self, so: SchedulerOutput, prev: InflightStep | None) -> InflightStep:
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
        if inp.num_draft_tokens:
            return self._verify(so, inp, logits, prompt_lps)
        if not self.is_driver:
            return InflightStep(so, self._receive_token_ids(len(inp.sampled)), to_host=False)
        if any(state.grammar is not None for state in inp.sampled):
            catch_up_grammars(so, inp.sampled, prev)
        smd = SamplingMetadata.from_requests(inp.sampled, logits.shape[-1], self.device,
                                             [s.num_output_tokens for s in so.sampled])
        out = sample(logits, smd)
        if self.tp_size > 1:        # the next step's pending inputs must be the same ids on every rank
            broadcast_tensor(out.token_ids)
        drafts = None
        if self.drafter is not None:
            drafts = self._draft(so, inp, [[t] for t in out.token_ids.tolist()])
        return InflightStep(so, out.token_ids, out.logprobs, inp.sampled, prompt_lps, spec_token_ids=drafts)

    def _verify(self, so: SchedulerOutput, inp: ModelInput, logits: torch.Tensor, prompt_lps) -> InflightStep:
        """A step that verifies drafts (speculative decoding): its tokens are read here, as the scheduler waits
        for them anyway (it drafts from them). Other ranks need nothing: no input of the next step is pending."""
        if not self.is_driver:
            return InflightStep(so, prompt_logprobs=prompt_lps, to_host=False)
        for state in inp.sampled:
            if state.grammar is not None:
                state.grammar.consume(state.output_token_ids)
        out = verify(logits, inp.sampled, so.sampled, self.device)
        drafts = self._draft(so, inp, out.token_ids) if self.drafter is not None else None
        return InflightStep(so, logprobs=out.logprobs, sampled=inp.sampled, prompt_logprobs=prompt_lps,
                            verified=out.token_ids, spec_token_ids=drafts)

    def _draft(self, so: SchedulerOutput, inp: ModelInput, new_tokens: list[list[int]]) -> dict[str, list[int]]:
        """EAGLE-3: feed the drafter every position this step computed and kept (a verify step keeps its input
        token and accepted drafts), each beside the token after it; draft for the requests that sampled."""
        sampled = {s.request_id: tokens for s, tokens in zip(so.sampled, new_tokens)}
        feeds = []
        for s in so.scheduled:
            state = self.requests[s.request_id]
            tokens = sampled.get(s.request_id)
            if tokens is not None:        # kept: the known inputs and accepted drafts, each followed by the next
                num_kept = s.num_scheduled_tokens - len(s.spec_token_ids) + len(tokens) - 1
                after = s.token_ids[1:num_kept] + tokens[-1:]
            else:                         # a prompt chunk that does not reach the end: the prompt continues it
                num_kept = s.num_scheduled_tokens
                after = s.token_ids[1:] + state.prompt_token_ids[s.end:s.end + 1]
            flat = inp.flat_starts[s.request_id]
            feeds.append(DraftFeed(s.request_id, list(range(s.num_computed_tokens, s.num_computed_tokens + num_kept)),
                                   torch.arange(flat, flat + num_kept), after, propose=tokens is not None))
        return self.drafter.propose(feeds, self.model.decoder.aux_hidden_states)

    def _receive_token_ids(self, num_sampled: int) -> torch.Tensor:
        """A worker rank's copy of the ids rank 0 sampled this step (on the device, like rank 0's)."""
        token_ids = torch.empty(num_sampled, dtype=torch.int64, device=self.device)
        return broadcast_tensor(token_ids)

    def update_states(self, so: SchedulerOutput) -> None:
        """Forget the requests that finished, learn the new ones; a preempted request's blocks are rewritten
        when it runs again."""
        for rid in so.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.input_batch.remove_request(state.row)
            if self.drafter is not None:
                self.drafter.forget(rid)
        for rid in so.preempted:
            if (state := self.requests.get(rid)) is not None:
                self.input_batch.reset_blocks(state.row)
            if self.drafter is not None:
                self.drafter.forget(rid)
        sampling_device = self.device if self.is_driver else None
        for new in so.scheduled_new_reqs:
            grammar = self.grammars.pop(new.request_id, None) if self.grammars is not None else None
            self.requests[new.request_id] = CachedRequestState.from_new(new, self.input_batch.add_request(),
                                                                        grammar, sampling_device)

    # ---- batch construction --------------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput, prev: InflightStep | None = None,
                       images: dict[str, EncoderOutput] | None = None) -> ModelInput:
        """The flat batch of step `so`; `images` are encode_images(so) when the caller ran it already. One pass
        over the scheduled requests gathers their per-request numbers; positions, slots and the block table
        are then whole-array operations over the persistent batch."""
        if images is None:
            images = self.encode_images(so)
        # Decodes (one token) first: the attention op runs them through its decode kernel.
        entries = sorted(so.scheduled, key=lambda s: s.num_scheduled_tokens != 1)
        batch = self.input_batch
        n = len(entries)
        rows, starts, counts = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        pending_flat, pending_rows = [], []      # batch rows whose input token is still on the device
        ids: list[int] = []
        chunks, scored = [], []
        logits_rows: list = [0] * len(so.sampled)    # per sampled row: its logits row (a verify step: k + 1)
        num_draft_tokens = 0
        flat_starts: dict[str, int] = {}
        flat = 0
        for i, s in enumerate(entries):
            req = self.requests[s.request_id]
            batch.append_blocks(req.row, s.block_ids)
            rows[i], starts[i], counts[i] = req.row, s.num_computed_tokens, s.num_scheduled_tokens
            ids.extend(s.token_ids)
            if s.pending_row is not None:         # its last input was sampled by the step in flight
                pending_flat.append(len(ids))
                pending_rows.append(s.pending_row)
                ids.append(0)
            chunks.append((req, flat, s.num_computed_tokens, s.end))
            if self.drafter is not None:
                flat_starts[s.request_id] = flat
            if req.sampling_params.prompt_logprobs is not None and s.num_computed_tokens < req.num_prompt_tokens - 1:
                scored.append((req, s, flat))
            flat += s.num_scheduled_tokens
            if s.sample_row is not None:
                k = len(s.spec_token_ids)
                logits_rows[s.sample_row] = range(flat - 1 - k, flat) if k else flat - 1
                num_draft_tokens += k
        seq_lens = starts + counts
        query_start = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=query_start[1:])
        first_of_token = np.repeat(query_start[:-1] - starts, counts)   # token t's position is t - this
        positions = np.arange(flat, dtype=np.int64) - first_of_token
        width = int(batch.num_blocks[rows].max())
        table = batch.block_table[rows, :width]
        bs = self.block_size
        slots = table[np.repeat(np.arange(n), counts), positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        pos = self._rope_positions(torch.from_numpy(positions), chunks, counts)
        query_start_cpu, seq_lens_cpu = query_start.tolist(), seq_lens.tolist()
        num_decodes = int(np.count_nonzero(counts == 1))
        md = AttentionMetadata(
            slot_mapping=to_device(torch.from_numpy(slots), torch.int64, dev),
            query_start_loc=to_device(torch.from_numpy(query_start), torch.int32, dev),
            seq_lens=to_device(torch.from_numpy(seq_lens), torch.int32, dev),
            block_tables=to_device(torch.from_numpy(table), torch.int32, dev),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_cpu, seq_lens_cpu=seq_lens_cpu)
        input_ids = to_device(ids, torch.int64, dev)
        if pending_flat:
            pending = to_device(pending_rows, torch.int64, dev)
            input_ids[to_device(pending_flat, torch.int64, dev)] = prev.token_ids[pending]
        return ModelInput(
            input_ids=input_ids,
            positions=to_device(pos, torch.int64, dev), md=md,
            logits_indices=to_device(_flatten(logits_rows) if num_draft_tokens else logits_rows, torch.int64, dev),
            num_draft_tokens=num_draft_tokens, flat_starts=flat_starts,
            sampled=[self.requests[s.request_id] for s in so.sampled], mm=self._multimodal_embeds(chunks, images),
            prompt_logprob_chunks=scored)

    def _rope_positions(self, positions: torch.Tensor, chunks, counts: np.ndarray) -> torch.Tensor:
        """1-D positions as they are, or M-RoPE's three axes: a prompt chunk's from its prompt's grid, a
        generated token's `position + delta` on every axis."""
        if self.config.mrope_section is None:
            return positions
        in_prompt = [start < req.num_prompt_tokens for req, _, start, _ in chunks]
        deltas = np.array([0 if p else req.prompt.mrope_position_delta for (req, *_), p in zip(chunks, in_prompt)],
                          dtype=np.int64)
        pos = (positions + torch.from_numpy(np.repeat(deltas, counts))).repeat(3, 1)
        for (req, flat, start, end), p in zip(chunks, in_prompt):
            if p:
                pos[:, flat:flat + end - start] = req.positions(start, end)
        return pos

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
        """Encode `images` (images and video frame groups) in batches of at most the patches of the largest image
        (the memory profile's, kv_sizing) and of a vision graph, or one larger item alone: a video's many frame
        groups in one step do not make one unbounded batch."""
        p = self.image_processor
        limit = min(MAX_GRAPH_PATCHES, p.max_pixels // p.patch_size ** 2) if p is not None else MAX_GRAPH_PATCHES
        out, batch, patches = {}, [], 0
        for image in images:
            n = image.grid_thw[0] * image.grid_thw[1] * image.grid_thw[2]
            if batch and patches + n > limit:
                out.update(self._encode_batch(batch))
                batch, patches = [], 0
            batch.append(image)
            patches += n
        out.update(self._encode_batch(batch))
        return out

    def _encode_batch(self, images) -> dict[str, EncoderOutput]:
        dtype = self.model.visual.pos_embed.weight.dtype     # the pixels come out in the encoder's dtype
        to_pixels = self.image_processor.to_pixel_values
        parts = [to_pixels(raw, dtype) for raw in self._upload([i.raw for i in images])]
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


def _flatten(rows: list) -> list[int]:
    return [r for item in rows for r in (item if isinstance(item, range) else (item,))]
