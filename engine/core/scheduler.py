"""Continuous batching: each step picks which requests run and how many tokens each computes.

One step = one forward. Steps are scheduled one ahead of the device; PendingTokens holds what that means.

Order: running requests (decodes and unfinished prefill chunks), then swapped-out requests coming back and
waiting ones, in policy order, all within max_num_batched_tokens and max_num_seqs. The swapped and waiting
queues stay in policy order as requests enter them (RequestQueue), so a step reads only the heads it admits,
however many requests wait. A prompt longer than the remaining budget is split across steps (chunked prefill),
so decodes keep flowing beside it.
When the pool runs dry the least important running request is preempted: swapped to the CPU pool when
it has room, else freed and recomputed later. "Least important" = latest arrival (fcfs), or largest
`priority` value then latest arrival (priority policy, lower value runs sooner, as in vLLM).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.pending_tokens import PendingTokens
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import QueueEntry, RequestQueue, create_request_queue
from engine.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.logger import init_logger
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import SpeculationPolicy

logger = init_logger(__name__)


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, policy: str = "fcfs",
                 speculative_config: SpeculativeConfig | None = None, waiting_is_free: bool = False):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: RequestQueue = create_request_queue(policy)
        self.swapped: RequestQueue = create_request_queue(policy)
        self.running: list[Request] = []           # at most max_num_seqs: sorted at the start of each step
        self._key = self.waiting.key               # the policy's rank of a request: lower goes first
        self.requests: dict[str, Request] = {}
        self.pending = PendingTokens()
        self.finished_req_ids: set[str] = set()      # since the last step, for the runner to forget
        self.counters = SchedulerCounters()
        # Speculative decoding: who drafts when (policy); n-gram drafts are looked up here, on the host.
        self.spec_policy = None
        if speculative_config is not None:
            self.spec_policy = SpeculationPolicy(speculative_config, waiting_is_free)
        self.ngram = None
        # An EAGLE-3 drafter reads every step's tokens on the device's side (ModelRunner._draft): none is pending.
        self.drafts_from_device = speculative_config is not None and speculative_config.method == "eagle3"
        if speculative_config is not None and speculative_config.method == "ngram":
            c = speculative_config
            self.ngram = NgramProposer(c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max)

    # ---- queues --------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.add_request(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_requests(self, reqs: list[Request], status: RequestStatus) -> None:
        """End requests (abort, stop): free their blocks and take them out of their queues. Each queue that held
        one is rebuilt once, in one pass: a burst of thousands of aborts costs O(queue length) in all, not one
        scan per request, and each request's own work is O(1) plus its blocks."""
        now = time.time()
        ended: set[str] = set()
        held: set[RequestStatus] = set()
        for req in reqs:
            if req.request_id in ended or req.is_finished:   # named twice, or finished already
                continue
            ended.add(req.request_id)
            held.add(req.status)
            req.status = status
            req.metrics.finished_time = now
            self.kv.free(req)
            self.pending.forget(req)
            if self.spec_policy is not None:
                self.spec_policy.forget(req.request_id)
            self.requests.pop(req.request_id, None)
            self.finished_req_ids.add(req.request_id)
        if RequestStatus.RUNNING in held:
            self.running[:] = [r for r in self.running if r.request_id not in ended]
        if RequestStatus.WAITING in held:
            self.waiting.remove_requests(ended)
        if RequestStatus.SWAPPED in held:
            self.swapped.remove_requests(ended)

    # ---- the step ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.running.sort(key=self._key)
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        self._set_speculating()
        drafts: dict[str, list[int]] = {}
        self._schedule_running(out, self.max_num_batched_tokens, drafts)
        if not out.preempted:
            self._admit(out)
        now = time.time()
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            if req.metrics.first_scheduled_time is None:       # the runner has not seen it yet
                req.metrics.first_scheduled_time = now
                out.scheduled_new_reqs.append(NewRequestData(rid, req.prompt, req.sampling_params,
                                                             req.eos_token_ids, req.bad_words_token_ids))
            start = req.num_computed_tokens
            req.num_computed_tokens = start + n
            draft = drafts.get(rid, ())
            token_ids = req.all_token_ids[start:start + n - len(draft)]
            if draft:
                token_ids += draft
            out.scheduled.append(ScheduledRequest(rid, n, start, token_ids, self.kv.block_ids(rid),
                                                  spec_token_ids=draft))
        out.needs_host_tokens = self.drafts_from_device
        if self.spec_policy is not None:
            out.speculative = self.spec_policy.is_speculative(
                bool(drafts), any(self.requests[s.request_id].speculating for s in out.scheduled))
        self.pending.on_scheduled(out, self.requests)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, drafts: dict[str, list[int]]) -> None:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self.pending.num_outputs(req) >= req.max_tokens:
                i += 1                                 # its last token is in flight: nothing more to compute
                continue
            n = min(self.pending.num_tokens(req) - req.num_computed_tokens, budget)
            draft = self._draft(req, budget - n) if req.speculating else ()
            n += len(draft)
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]          # least important; never one already scheduled this step
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.num_scheduled_tokens[req.request_id] = n
                if draft:
                    drafts[req.request_id] = draft
                budget -= n
                i += 1
                continue
            break

    # ---- speculative decoding ------------------------------------------------------------------------------
    def _set_speculating(self) -> None:
        """Which running requests speculate this step (SpeculationPolicy)."""
        if self.spec_policy is None:
            return
        small = self.spec_policy.on_schedule(len(self.running))
        for req in self.running:
            req.speculating = small and self.spec_policy.allows(req.request_id)

    def _draft(self, req: Request, room: int) -> list[int]:
        """The draft tokens `req` verifies this step: only in a decode step whose every token is on the host, at
        most `room` (the step's token budget left) and never past max_tokens."""
        draft, req.spec_token_ids = req.spec_token_ids, []
        if self.pending.count(req) or req.num_computed_tokens != req.num_tokens - 1:
            return []
        limit = min(room, req.max_tokens - req.num_output_tokens - 1)
        if self.ngram is not None:
            return self.ngram.propose(req.all_token_ids, limit)
        return draft[:max(limit, 0)]

    def _admit(self, out: SchedulerOutput) -> None:
        """Bring in swapped-out and waiting requests in policy order, stopping at the first that does not fit
        (so nothing overtakes a more important request that is still waiting for room). A request preempted
        during this step, or one with a pending token, is passed over and keeps its place."""
        passed_over: list[tuple[RequestQueue, QueueEntry]] = []
        while (queue := self._next_queue()) is not None:
            req = queue.peek_request()
            if self.pending.count(req) or req.request_id in out.preempted:
                passed_over.append((queue, queue.pop_entry()))
                continue
            budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            admitted = self._swap_in(out, req, budget) if queue is self.swapped else self._start(out, req, budget)
            if not admitted:
                break
        for queue, entry in passed_over:
            queue.push_entry(entry)

    def _next_queue(self) -> RequestQueue | None:
        """The queue whose head comes next in policy order; on a tie, swapped-out requests go first."""
        if not self.swapped or not self.waiting:
            return self.swapped or self.waiting or None
        swapped_first = self._key(self.swapped.peek_request()) <= self._key(self.waiting.peek_request())
        return self.swapped if swapped_first else self.waiting

    def _swap_in(self, out: SchedulerOutput, req: Request, budget: int) -> bool:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.kv.can_swap_in(req, n):
            return False
        self.swapped.pop_request()                     # req: it is the head
        copies = self.kv.swap_in(req)
        out.blocks_to_swap_in.extend(copies)
        self.counters.num_swap_ins += 1
        self.counters.num_blocks_swapped_in += len(copies)
        assert self.kv.allocate_slots(req, n)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.num_scheduled_tokens[req.request_id] = n
        return True

    def _start(self, out: SchedulerOutput, req: Request, budget: int) -> bool:
        hits, num_cached = self.kv.get_computed_blocks(req)
        n = min(req.num_tokens - num_cached, budget)
        while not self.kv.allocate_slots(req, n, hits):
            victim = self._priority_victim(req)
            if victim is None:
                return False
            self._preempt(victim, out)
            n = min(req.num_tokens - num_cached, self.max_num_batched_tokens - out.total_num_scheduled_tokens)
        self.waiting.pop_request()                     # req: still the head, as victims rank below it
        req.num_computed_tokens = num_cached
        req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, num_cached)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.num_scheduled_tokens[req.request_id] = n
        return True

    def _priority_victim(self, incoming: Request) -> Request | None:
        """Under the priority policy a waiting request may push out a strictly less important running one."""
        if self.policy != "priority" or not self.running:
            return None
        victim = self.running[-1]
        return victim if self._key(victim) > self._key(incoming) and victim.priority > incoming.priority else None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        out.num_scheduled_tokens.pop(req.request_id, None)   # un-schedule it from this step
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        out.preempted.append(req.request_id)
        if self.kv.can_swap_out(req):
            copies = self.kv.swap_out(req)
            out.blocks_to_swap_out.extend(copies)
            req.status = RequestStatus.SWAPPED
            self.swapped.add_request(req)
            self.counters.num_swap_outs += 1
            self.counters.num_blocks_swapped_out += len(copies)
            mode = "SWAP"
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.prepend_request(req)
            self.counters.num_recompute_preemptions += 1
            mode = "RECOMPUTE"
        logger.warning(
            "Request %s is preempted by PreemptionMode.%s mode because there is not enough KV cache space. "
            "This can affect the end-to-end performance. Increase gpu_memory_utilization or swap_space to "
            "provide more KV cache memory. total_num_cumulative_preemption=%d",
            req.request_id, mode, self.counters.num_preemptions)

    # ---- after the forward ---------------------------------------------------------------------------------
    def record_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        """Step `out` took this long, from the previous step's tokens (or its own launch) to its own: the costs
        that SpeculationPolicy weighs drafts against."""
        policy = self.spec_policy
        if policy is not None and policy.speculates_at(len(out.scheduled)) and out.is_pure_decode:
            policy.costs.observe(len(out.scheduled), out.speculative, seconds)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           spec_token_ids: dict[str, list[int]] | None = None) -> list[tuple[Request, int]]:
        """Step `out` finished: append its sampled tokens (a verify step's accepted drafts and the token after
        them), give back the KV of rejected drafts, cache the full blocks it computed, finish requests on
        token-level stop conditions. Requests finished meanwhile (abort, stop string) are skipped.
        `spec_token_ids`: drafts a drafter on the device made for the next step. Returns (request, number of
        new tokens) for the requests that received tokens."""
        updated = []
        finished: dict[RequestStatus, list[Request]] = {}
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:                            # finished meanwhile
                continue
            tokens = sampled.get(req.request_id)
            if s.spec_token_ids:
                self._roll_back(req, s, tokens)
            if req.speculating and tokens is not None:
                self.spec_policy.record(req.request_id, len(s.spec_token_ids), len(tokens) - 1, len(out.scheduled))
            status = None
            if tokens is not None:
                tokens, status = self._until_stop(req, tokens)
                self.pending.on_tokens(req, tokens)
                updated.append((req, len(tokens)))
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_computed_blocks(req)
            if status is not None:
                finished.setdefault(status, []).append(req)
            elif spec_token_ids and req.request_id in spec_token_ids:
                req.spec_token_ids = spec_token_ids[req.request_id]
        for status, reqs in finished.items():      # one pass over `running` for all that ended this step
            self.finish_requests(reqs, status)
        return updated

    def _roll_back(self, req: Request, s, tokens: list[int] | None) -> None:
        """A verify step keeps the KV of its accepted drafts only: the rest is forgotten. Their slots stay with the
        request, as its next step writes them again (the runner's copy of its block table never shrinks)."""
        accepted = len(tokens) - 1 if tokens is not None else 0
        if req.status != RequestStatus.RUNNING or req.num_computed_tokens != s.end:
            return                                 # preempted since: its KV is being rebuilt anyway
        req.num_computed_tokens -= len(s.spec_token_ids) - accepted

    def _until_stop(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """The tokens up to and including the first that ends the request, and how it ends (None: it goes on).
        A verify step can yield several tokens: those after a stop token are never output."""
        for i, token in enumerate(tokens):
            status = self._check_stop(req, token, req.num_output_tokens + i + 1)
            if status is not None:
                return tokens[:i + 1], status
        return tokens, None

    def _check_stop(self, req: Request, token: int, num_outputs: int) -> RequestStatus | None:
        """Whether `token`, the request's num_outputs-th output token, ends it."""
        params = req.sampling_params
        if num_outputs >= params.min_tokens:
            if token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_outputs >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
