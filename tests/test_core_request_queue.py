"""RequestQueue: the waiting and swapped queues stay in policy order as requests enter, and give exactly the order a
full stable sort by the policy key gives of a plain list kept the simple way: a new request appended, a request
preempted for recompute inserted at the front, finished ones filtered out. Random sequences of operations, both
policies, arrival times that tie and arrive out of order; then the same through the scheduler, step by step."""
import random

import pytest
from core_helpers import StepLoop

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from engine.core.scheduler import Scheduler
from engine.inputs.types import ProcessedPrompt
from engine.sampling_params import SamplingParams

POLICIES = ("fcfs", "priority")
EOS = 2


def key(policy):
    return (lambda r: (r.priority, r.arrival_time)) if policy == "priority" else (lambda r: (r.arrival_time,))


def random_request(rng: random.Random, n: int) -> Request:
    """Arrival times from a small set (ties, and older requests that reach the queue after newer ones)."""
    prompt = list(range(10, 10 + rng.randint(1, 10)))
    max_tokens = rng.randint(1, 6)
    return Request(f"r{n}", ProcessedPrompt(prompt), SamplingParams(max_tokens=max_tokens), [EOS], max_tokens,
                   priority=rng.randint(0, 2), arrival_time=float(rng.randint(0, 5)))


def ids(requests):
    return [r.request_id for r in requests]


def test_the_policy_key_is_arrival_time_or_priority_then_arrival_time():
    req = random_request(random.Random(0), 0)
    assert FCFSRequestQueue.key(req) == req.arrival_time
    assert PriorityRequestQueue.key(req) == (req.priority, req.arrival_time)
    with pytest.raises(ValueError, match="'fcfs' or 'priority'"):
        create_request_queue("lifo")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(20))
def test_the_queue_yields_what_a_full_sort_of_the_plain_list_yields(policy, seed):
    rng = random.Random(seed)
    queue, plain, made = create_request_queue(policy), [], 0
    for _ in range(300):
        op = rng.choice(["add", "add", "add", "preempt", "admit", "pass_over", "abort", "finish"])
        expected = sorted(plain, key=key(policy))          # stable: ties keep the plain list's order
        if op in ("add", "preempt"):
            req, made = random_request(rng, made), made + 1
            if op == "add":
                queue.add_request(req)
                plain.append(req)
            else:
                queue.prepend_request(req)
                plain.insert(0, req)
        elif op == "admit" and plain:
            assert queue.peek_request() is expected[0]
            assert queue.pop_request() is expected[0]
            plain.remove(expected[0])
        elif op == "pass_over" and plain:                  # heads taken aside for a step, then put back
            entries = [queue.pop_entry() for _ in range(rng.randint(1, len(plain)))]
            assert [e[2] for e in entries] == expected[:len(entries)]
            for entry in rng.sample(entries, len(entries)):
                queue.push_entry(entry)
        elif op in ("abort", "finish") and plain:          # a batch of them at once
            gone = {r.request_id for r in rng.sample(plain, rng.randint(1, len(plain)))}
            queue.remove_requests(gone)
            plain = [r for r in plain if r.request_id not in gone]
        assert ids(queue) == ids(sorted(plain, key=key(policy)))
        assert len(queue) == len(plain) and bool(queue) == bool(plain)


def test_equal_keys_keep_entry_order_and_a_request_put_back_goes_before_them():
    queue = create_request_queue("fcfs")
    a, b, c, d = (random_request(random.Random(0), n) for n in range(4))
    for req in (a, b, c, d):
        req.arrival_time = 5.0
    queue.add_request(a)
    queue.add_request(b)
    queue.prepend_request(c)
    queue.prepend_request(d)
    assert ids(queue) == ["r3", "r2", "r0", "r1"]


# ---- through the scheduler -----------------------------------------------------------------------------------
def random_scheduler(rng: random.Random, policy: str) -> Scheduler:
    """A pool small enough to preempt (recompute, or swap when there is swap space), a small budget."""
    kv = KVCacheManager(rng.randint(4, 10), rng.choice([0, 0, 3, 8]), 4, rng.random() < 0.5)
    return Scheduler(kv, rng.randint(4, 24), rng.randint(1, 5), policy)


class PlainQueues:
    """The swapped and waiting queues as plain lists, kept from what each step reports."""

    def __init__(self, policy: str):
        self.key = key(policy)
        self.waiting: list[Request] = []
        self.swapped: list[Request] = []

    def admission_order(self) -> list[Request]:
        """A full stable sort of swapped-out then waiting requests: swapped ones first among equals."""
        return sorted(self.swapped + self.waiting, key=self.key)

    def after_step(self, so, requests: dict[str, Request], queued: set[str]) -> None:
        for rid in so.num_scheduled_tokens:
            if rid in queued:
                self.waiting = [r for r in self.waiting if r.request_id != rid]
                self.swapped = [r for r in self.swapped if r.request_id != rid]
        for rid in so.preempted:
            req = requests[rid]
            if req.status == RequestStatus.SWAPPED:
                self.swapped.append(req)
            else:
                self.waiting.insert(0, req)

    def drop_finished(self) -> None:
        self.waiting = [r for r in self.waiting if not r.is_finished]
        self.swapped = [r for r in self.swapped if not r.is_finished]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(40))
def test_each_step_admits_in_the_order_of_a_full_sort_of_the_plain_queues(policy, seed):
    rng = random.Random(seed)
    sched = random_scheduler(rng, policy)
    loop = StepLoop(sched, next_token=lambda req: EOS if rng.random() < 0.15 else 1000)
    plain, made, admitted_any, preempted_any = PlainQueues(policy), 0, False, False
    for _ in range(120):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            req, made = random_request(rng, made), made + 1
            sched.add_request(req)
            plain.waiting.append(req)
        if rng.random() < 0.1 and sched.requests:
            batch = rng.sample(list(sched.requests.values()), rng.randint(1, min(3, len(sched.requests))))
            sched.finish_requests(batch, RequestStatus.FINISHED_ABORTED)
            plain.drop_finished()
        expected = plain.admission_order()
        queued = {r.request_id for r in expected}
        requests = dict(sched.requests)
        so = loop.step()
        admitted = [rid for rid in so.num_scheduled_tokens if rid in queued]
        assert admitted == ids(expected[:len(admitted)])
        admitted_any |= bool(admitted)
        preempted_any |= bool(so.preempted)
        plain.after_step(so, requests, queued)
        plain.drop_finished()
        assert ids(sched.waiting) == ids(sorted(plain.waiting, key=plain.key))
        assert ids(sched.swapped) == ids(sorted(plain.swapped, key=plain.key))
    assert admitted_any and made > 50
