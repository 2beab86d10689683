"""A request's state inside the engine core: its tokens, how many have KV in the cache, where it is queued."""
from __future__ import annotations

import array
import enum
import hashlib
import time

from engine.inputs.types import ImageItem, ProcessedPrompt
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"                      # not yet (or no longer, after recompute preemption) holding KV
    RUNNING = "running"
    SWAPPED = "swapped"                      # preempted, its KV blocks parked in the CPU swap pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(self, request_id: str, prompt: ProcessedPrompt, sampling_params: SamplingParams,
                 eos_token_ids: list[int], max_tokens: int, priority: int = 0,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.prompt_token_ids = list(prompt.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens                     # resolved against max_model_len by the engine
        self.eos_token_ids = set() if sampling_params.ignore_eos else set(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0                     # tokens whose KV is in the cache (or being written)
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []              # chained hashes of its full blocks (prefix caching)
        self.prefix_cache_counted = False                # its lookup is in the prefix-cache stats already
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.output_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = None   # when asked: one per prompt token
        # Handed to the runner once (NewRequestData), which alone uses them from then on.
        self.bad_words_token_ids: list[list[int]] = []   # bad_words, tokenized by the engine
        # Its sampling reads every earlier token id (penalties, multi-token bad words): a step that samples it
        # is read before the next is scheduled (PendingTokens.on_scheduled). The engine adds bad words.
        self.needs_host_tokens = sampling_params.has_penalties
        # Speculative decoding: whether it drafts this step (the scheduler's SpeculationPolicy decides), and the
        # draft a drafter running on the device left for its next step (EAGLE-3; n-gram drafts at schedule time).
        self.speculating = False
        self.spec_token_ids: list[int] = []

    # ---- sizes ---------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def images(self) -> list[ImageItem]:
        return self.prompt.images

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        """A token sampled by an earlier step has reached the host (through PendingTokens.on_tokens)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    # ---- prefix-cache block hashes ------------------------------------------------------------------------
    def update_block_hashes(self, block_size: int) -> None:
        """Extend block_hashes over every full block. A block's hash chains its parent's, its token ids and
        the content hash of every image whose placeholder tokens overlap it: identical <|image_pad|> ids of two
        different images never share KV."""
        while (len(self.block_hashes) + 1) * block_size <= self.num_tokens:
            i = len(self.block_hashes)
            start, end = i * block_size, (i + 1) * block_size
            h = hashlib.blake2b(digest_size=16)
            h.update(self.block_hashes[-1] if self.block_hashes else b"root")
            h.update(array.array("q", self.all_token_ids[start:end]).tobytes())
            for image in self.images:
                if image.offset < end and image.end > start:
                    h.update(image.content_hash.encode())
            self.block_hashes.append(h.digest())
