"""What the scheduler hands the model runner for one step: the whole contract between the two, as in vLLM v1.
The runner learns a request's fixed data once (NewRequestData), then each step only what the step changes, and
never asks the scheduler, a Request or the KV cache manager. Plain, picklable data: under tensor parallelism
it is broadcast to every rank as it is. What only the sampling rank uses and cannot travel (a structured-output
matcher) stays in rank 0's registry (LLMEngine.grammars); a seeded request's generator is made by the runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.inputs.types import ProcessedPrompt
from engine.sampling_params import SamplingParams


@dataclass(eq=False)
class NewRequestData:
    """A request's fixed data, sent the first step it is scheduled; the runner keeps it until the request's id
    comes back in finished_req_ids."""
    request_id: str
    prompt: ProcessedPrompt                  # token ids, images (uint8 pixels), M-RoPE positions
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    bad_words_token_ids: list[list[int]] = field(default_factory=list)   # bad_words, tokenized by the engine


@dataclass(eq=False, slots=True)
class ScheduledRequest:
    """One request's part of a step: tokens [num_computed_tokens, num_computed_tokens + num_scheduled_tokens)."""
    request_id: str
    num_scheduled_tokens: int
    num_computed_tokens: int           # tokens whose KV is cached (or being written) before this step
    token_ids: list[int]               # the chunk's ids known on the host (all but a pending last one), drafts
                                       # included
    block_ids: list[int]               # its block table, long enough for the chunk
    pending_row: int | None = None     # its last input is pending: this row of the in-flight step's sampled ids
    sample_row: int | None = None      # this step samples its next token into this row of its sampled ids
    num_output_tokens: int = 0         # when sampling: outputs before that token, pending ones included
    spec_token_ids: list[int] | tuple = ()   # draft tokens: the chunk's last len(...) ids, verified this step

    @property
    def end(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)   # first scheduled in this step
    scheduled: list[ScheduledRequest] = field(default_factory=list)          # in scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)       # request id -> tokens, same order
    sampled: list[ScheduledRequest] = field(default_factory=list)       # the requests that sample, in row order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu, cpu), run first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, gpu), run second
    finished_req_ids: set[str] = field(default_factory=set)   # finished since the last step: the runner forgets them
    preempted: list[str] = field(default_factory=list)        # request ids
    needs_host_tokens: bool = False    # the next step waits for this one's sampled ids (see PendingTokens)
    speculative: bool = False          # it costs what speculation costs (SpeculationPolicy.is_speculative)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_pure_decode(self) -> bool:
        """Every request computes one token and its drafts (no prompt chunk, no swap): a step whose time says
        what decoding costs at this batch size."""
        return (bool(self.scheduled) and not self.blocks_to_swap_out and not self.blocks_to_swap_in
                and all(s.num_scheduled_tokens == 1 + len(s.spec_token_ids) for s in self.scheduled))

    @property
    def is_empty(self) -> bool:
        """Nothing for the device to do (the runner may still have finished requests to forget)."""
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in
