"""A launched step (InflightStep) and what it returns to the engine core once its tokens reach the host
(StepResult), including the prompt logprobs scored in it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.worker.input_batch import CachedRequestState


class InflightStep:
    """A launched step: its sampled token ids are on their way to a host buffer. result() waits only for this
    step's work (an event), never for a later step queued behind it."""

    def __init__(self, so: SchedulerOutput, token_ids: torch.Tensor | None = None, logprobs: list | None = None,
                 sampled: list[CachedRequestState] = (), prompt_logprobs: list[PromptLogprobs] = (),
                 to_host: bool = True, verified: list[list[int]] | None = None,
                 spec_token_ids: dict[str, list[int]] | None = None):
        """A verify step (speculative decoding) passes its tokens on the host instead of token_ids:
        `verified[i]` for so.sampled[i] (its accepted drafts and one more), `logprobs[i]` one entry per token,
        and any drafts made for the next step (`spec_token_ids`)."""
        self.so = so
        self.token_ids = token_ids                # [S] on the device, row i for so.sampled[i] (pending inputs)
        self.prompt_logprobs = list(prompt_logprobs)   # chunks scored this step, on the device until result()
        self.logprobs = logprobs
        self.verified = verified
        self.spec_token_ids = spec_token_ids or {}
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
            ids = [s.request_id for s in self.so.sampled]
            self._result.spec_token_ids = self.spec_token_ids
            if self.verified is not None:
                tokens, logprobs = self.verified, self.logprobs
            elif self.token_ids is not None:
                if self._event is not None:
                    self._event.synchronize()
                    tokens = [[t] for t in self._host.tolist()]
                else:
                    tokens = [[t] for t in self.token_ids.tolist()]
                logprobs = [[lp] for lp in self.logprobs] if self.logprobs else None
            else:
                return self._result
            for state, new in zip(self._sampled, tokens):
                state.output_token_ids.extend(new)
            self._result.sampled = dict(zip(ids, tokens))
            self._result.logprobs = dict(zip(ids, logprobs)) if logprobs else {}
        return self._result


@dataclass
class StepResult:
    sampled: dict[str, list[int]] = field(default_factory=dict)        # request id -> its new token ids (one,
                                                                       # or a verify step's accepted drafts + 1)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)   # request id -> one per token
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)   # request id -> drafts for its next step
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
