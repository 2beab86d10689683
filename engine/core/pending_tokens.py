"""Scheduling one step ahead: the tokens launched steps sampled whose ids have not reached the host yet."""
from __future__ import annotations

from collections.abc import Mapping

from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput


class PendingTokens:
    """The engine schedules and launches step N+1 before it reads step N's sampled ids (vLLM's async scheduling),
    so the host never waits for the device between steps. Meanwhile a request can have tokens that exist only on
    the device: its pending tokens. This object is their one record, and this the invariant it keeps:

        A request's tokens are its host-known `all_token_ids` followed by `count(request)` pending tokens.
        When a step is scheduled, at most one launched step is unread (LLMEngine._inflight), so a request
        has at most one pending token then, and it is a row of that step's sampled ids: the row recorded here.

    What follows, and where it is used:
    - the scheduler schedules a request up to num_tokens() and counts pending tokens against max_tokens
      (num_outputs()); a chunk reaching the newest token samples one more pending token (on_scheduled());
    - the step carries, per request, `pending_row` (its last input is pending: the runner takes it from the
      in-flight step's output on the device), `sample_row` and `num_output_tokens` (min_tokens counts pending
      outputs);
    - a pending token lands through on_tokens() when the engine reads its step's result;
    - a preempted request is admitted again only once nothing is pending for it (its ids must be known);
    - a block ending in a pending token is hashed for the prefix cache only once the token lands;
    - a finished request's id is taken again only once no launched step holds a token for it
      (LLMEngine.add_request): a landing token finds its request by id;
    - penalties and multi-token bad words read every earlier token id, so a step that samples with them is read
      before the next step is scheduled (Request.needs_host_tokens -> SchedulerOutput.needs_host_tokens): then
      nothing is pending at schedule time. So does a speculating request (Request.speculating): its drafts
      continue tokens the host must know.
    """

    def __init__(self) -> None:
        self._count: dict[str, int] = {}    # request id -> pending tokens (absent: none yet)
        self._rows: dict[str, int] = {}     # request id -> its row in the last scheduled step's sampled ids

    def count(self, req: Request) -> int:
        return self._count.get(req.request_id, 0)

    def num_tokens(self, req: Request) -> int:
        """All its tokens, pending ones included."""
        return req.num_tokens + self._count.get(req.request_id, 0)

    def num_outputs(self, req: Request) -> int:
        """Its output tokens, pending ones included."""
        return req.num_output_tokens + self._count.get(req.request_id, 0)

    def on_scheduled(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Step `so` is scheduled (every num_computed_tokens already advanced past its chunk): note which inputs
        are pending, and give a sampled row and a new pending token to each chunk that reaches the newest token."""
        rows: dict[str, int] = {}
        count = self._count
        for s in so.scheduled:
            rid = s.request_id
            req = requests[rid]
            end, known, pending = s.end - len(s.spec_token_ids), req.num_tokens, count.get(rid, 0)
            if end > known:
                s.pending_row = self._rows[rid]
            if end == known + pending:
                s.num_output_tokens = req.num_output_tokens + pending
                s.sample_row = rows[rid] = len(rows)
                count[rid] = pending + 1
                so.sampled.append(s)
                if req.needs_host_tokens or req.speculating:
                    so.needs_host_tokens = True
        self._rows = rows

    def on_tokens(self, req: Request, token_ids: list[int]) -> None:
        """A pending token of `req` reached the host: one id, or a verify step's accepted drafts and the token
        after them."""
        for token_id in token_ids:
            req.append_output_token(token_id)
        self._count[req.request_id] -= 1

    def forget(self, req: Request) -> None:
        """`req` finished: a token still in flight for it is dropped when it lands."""
        self._count.pop(req.request_id, None)
