"""Scheduler: each step picks which requests run and how many tokens each computes, and hands the runner a
SchedulerOutput that says everything about the step (each request's chunk, its token ids and block table, where
pending inputs come from, which rows it samples into). Block size 4; StepLoop plays the engine: step N+1 is
scheduled before step N's sampled tokens reach the host, and the "device" samples 1000, 1001, ..."""
import time

from core_helpers import EOS, StepLoop, make_request

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler

BS = 4


def scheduler(num_gpu_blocks=64, num_cpu_blocks=0, budget=64, max_num_seqs=8, policy="fcfs", caching=False):
    return Scheduler(KVCacheManager(num_gpu_blocks, num_cpu_blocks, BS, caching), budget, max_num_seqs, policy)


def chunks(so):
    return {s.request_id: (s.num_computed_tokens, s.num_scheduled_tokens) for s in so.scheduled}


# ---- budgets -------------------------------------------------------------------------------------------------
def test_a_step_computes_at_most_max_num_batched_tokens_and_splits_the_prompt_that_crosses_it():
    sched = scheduler(budget=10)
    for rid in "abc":
        sched.add_request(make_request(rid, 6))
    so = sched.schedule()
    assert chunks(so) == {"a": (0, 6), "b": (0, 4)}          # c waits: nothing left of the budget
    assert [s.request_id for s in so.sampled] == ["a"]        # b's chunk does not reach its last token
    assert so.total_num_scheduled_tokens == 10


def test_running_requests_come_first_then_waiting_ones_take_what_is_left():
    sched = scheduler(budget=10)
    loop = StepLoop(sched)
    for rid in "abc":
        sched.add_request(make_request(rid, 6))
    loop.step()
    so = loop.step()
    assert chunks(so) == {"a": (6, 1), "b": (4, 2), "c": (0, 6)}


def test_at_most_max_num_seqs_requests_run_at_once():
    sched = scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    assert list(chunks(sched.schedule())) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


# ---- chunked prefill -----------------------------------------------------------------------------------------
def test_a_long_prompt_runs_in_chunks_and_samples_only_after_its_last_one():
    sched = scheduler(budget=4)
    req = make_request("a", list(range(100, 110)))
    sched.add_request(req)
    steps = [sched.schedule() for _ in range(3)]
    assert [chunks(so)["a"] for so in steps] == [(0, 4), (4, 4), (8, 2)]
    assert [s.token_ids for so in steps for s in so.scheduled] == [[100, 101, 102, 103], [104, 105, 106, 107],
                                                                   [108, 109]]
    assert [s.block_ids for so in steps for s in so.scheduled] == [[0], [0, 1], [0, 1, 2]]
    assert [len(so.sampled) for so in steps] == [0, 0, 1]


def test_decodes_keep_flowing_beside_a_long_prompt():
    sched = scheduler(budget=4)
    loop = StepLoop(sched)
    sched.add_request(make_request("short", 2))
    loop.step()
    sched.add_request(make_request("long", 20))
    so = loop.step()
    assert chunks(so) == {"short": (2, 1), "long": (0, 3)}


# ---- one step ahead ------------------------------------------------------------------------------------------
def test_a_decode_takes_its_input_from_the_step_in_flight_without_waiting_for_it():
    sched = scheduler()
    loop = StepLoop(sched)
    for rid in "ab":
        sched.add_request(make_request(rid, 5))
    first = loop.step()
    assert [s.sample_row for s in first.scheduled] == [0, 1]
    second = loop.step()                                      # scheduled before `first`'s tokens landed
    b = next(s for s in second.scheduled if s.request_id == "b")
    assert (b.num_computed_tokens, b.num_scheduled_tokens, b.token_ids, b.pending_row) == (5, 1, [], 1)
    assert sched.requests["b"].output_token_ids == [1000]     # landed after `second` was scheduled


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again():
    sched = scheduler()
    loop = StepLoop(sched)
    req = make_request("a", 4, max_tokens=2)
    sched.add_request(req)
    loop.step()                                               # prefill: samples output 1
    assert chunks(loop.step()) == {"a": (4, 1)}               # decode: samples output 2, the last one
    assert loop.step().is_empty                               # nothing left to compute while it is in flight
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [1000, 1001]


def test_a_token_sampled_after_a_stop_token_is_dropped_when_it_lands():
    sched = scheduler()
    loop = StepLoop(sched, next_token=lambda req: EOS)
    req = make_request("a", 4)
    sched.add_request(req)
    loop.run()
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [EOS]
    assert not sched.kv.requests


def test_min_tokens_counts_outputs_still_in_flight():
    sched = scheduler()
    loop = StepLoop(sched)
    sched.add_request(make_request("a", 4, min_tokens=2))
    first, second = loop.step(), loop.step()
    assert first.sampled[0].num_output_tokens == 0 and second.sampled[0].num_output_tokens == 1



def test_a_step_sampling_a_request_that_reads_its_earlier_tokens_is_read_before_the_next_is_scheduled():
    plain, penalised, bad_words = make_request("a", 4), make_request("b", 4, repetition_penalty=1.2), \
        make_request("c", 4)
    bad_words.needs_host_tokens = True           # set by the engine for a multi-token bad word
    assert not plain.needs_host_tokens and penalised.needs_host_tokens
    for req in (plain, penalised, bad_words):
        only = scheduler()
        only.add_request(req)
        assert only.schedule().needs_host_tokens == req.needs_host_tokens

# ---- preemption ----------------------------------------------------------------------------------------------
def test_out_of_blocks_without_swap_space_the_newest_request_is_freed_and_later_recomputed():
    sched = scheduler(num_gpu_blocks=4)
    loop = StepLoop(sched)
    a, b = make_request("a", 8, max_tokens=2), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    loop.step()                                               # both prompts: all 4 blocks
    so = loop.step()                                          # a's decode needs a 5th block
    assert so.preempted == ["b"] and chunks(so) == {"a": (8, 1)}
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert loop.step().is_empty                               # b does not fit beside a yet
    so = loop.step()                                          # a finished: b recomputes prompt and output
    assert chunks(so) == {"b": (0, 8)} and so.scheduled[0].token_ids == list(range(10, 17)) + [1000]
    assert sched.counters.num_recompute_preemptions == 1 and b.num_preemptions == 1


def test_out_of_blocks_with_swap_space_the_newest_request_waits_in_the_cpu_pool():
    sched = scheduler(num_gpu_blocks=4, num_cpu_blocks=4)
    loop = StepLoop(sched)
    a, b = make_request("a", 8, max_tokens=2), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    loop.step()
    so = loop.step()
    assert so.preempted == ["b"] and len(so.blocks_to_swap_out) == 2        # (gpu, cpu) copies
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 7
    parked = [cpu for _, cpu in so.blocks_to_swap_out]
    loop.step()
    so = loop.step()                                          # back, with its KV: only its new token computes
    assert [cpu for cpu, _ in so.blocks_to_swap_in] == parked
    assert chunks(so) == {"b": (7, 1)} and so.scheduled[0].token_ids == [1000]
    assert sched.counters.num_swap_outs == 1 and sched.counters.num_swap_ins == 1


def test_admission_stops_at_the_first_request_that_does_not_fit():
    sched = scheduler(num_gpu_blocks=3)
    sched.add_request(make_request("big", 16))                # 4 blocks: never now
    sched.add_request(make_request("small", 3))
    assert sched.schedule().is_empty                          # small does not overtake big


# ---- priority ------------------------------------------------------------------------------------------------
def test_under_the_priority_policy_a_lower_value_is_admitted_first():
    sched = scheduler(budget=4, policy="priority")
    sched.add_request(make_request("later", 4, priority=1))
    sched.add_request(make_request("sooner", 4, priority=0))
    assert list(chunks(sched.schedule())) == ["sooner"]


def test_under_the_priority_policy_an_important_request_preempts_a_less_important_one():
    sched = scheduler(num_gpu_blocks=4, policy="priority")
    loop = StepLoop(sched)
    low = make_request("low", 10, priority=5)
    sched.add_request(low)
    loop.step()                                               # 3 blocks
    sched.add_request(make_request("high", 8, priority=0))    # needs 2
    so = loop.step()
    assert so.preempted == ["low"] and list(chunks(so)) == ["high"]


def test_a_request_preempted_to_make_room_waits_for_the_next_step_though_a_chunk_of_it_would_fit():
    sched = scheduler(num_gpu_blocks=4, budget=12, policy="priority")
    loop = StepLoop(sched)
    low = make_request("low", 10, priority=5)
    sched.add_request(low)
    loop.step()
    loop.land()                                               # 3 blocks; nothing of it in flight
    sched.add_request(make_request("high", 8, priority=0))   # needs 2: low goes, 2 blocks and 4 tokens stay free
    so = loop.step()
    assert so.preempted == ["low"] and chunks(so) == {"high": (0, 8)}
    assert low.status == RequestStatus.WAITING and [r.request_id for r in sched.waiting] == ["low"]


def test_under_fcfs_a_newcomer_waits_for_room_instead():
    sched = scheduler(num_gpu_blocks=4)
    loop = StepLoop(sched)
    sched.add_request(make_request("first", 10, priority=5))
    loop.step()
    sched.add_request(make_request("second", 8, priority=0))
    so = loop.step()
    assert not so.preempted and list(chunks(so)) == ["first"]


def test_finishing_a_request_frees_its_blocks_at_once():
    sched = scheduler(num_gpu_blocks=4)
    req = make_request("a", 10)
    sched.add_request(req)
    sched.schedule()
    sched.finish_requests([req], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 4 and not sched.has_unfinished_requests()


def test_a_burst_of_aborts_is_one_pass_over_the_queues():
    """Sixteen thousand requests (256 running, the rest waiting) aborted newest first, as every client of a full
    server leaving at once: one batch, each queue rebuilt once. Finishing them one by one, each a scan of the
    waiting list, takes seconds."""
    sched = Scheduler(KVCacheManager(20_000, 0, BS, False), 8192, 256)
    loop = StepLoop(sched)
    reqs = [make_request(f"r{i}", 5) for i in range(16_384)]
    for req in reqs:
        sched.add_request(req)
    loop.step()
    assert len(sched.running) == 256
    start = time.perf_counter()
    sched.finish_requests(reqs[::-1], RequestStatus.FINISHED_ABORTED)
    assert time.perf_counter() - start < 1.0
    assert not sched.has_unfinished_requests() and not sched.requests
    loop.land()
    assert sched.kv.num_free_blocks == 20_000 and all(r.status == RequestStatus.FINISHED_ABORTED for r in reqs)


def test_a_request_named_twice_in_a_batch_is_finished_once():
    sched = scheduler(num_gpu_blocks=8)
    a, b = make_request("a", 6), make_request("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    sched.finish_requests([a, a, b], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests([a], RequestStatus.FINISHED_STOPPED)        # already finished: nothing happens
    assert a.status == RequestStatus.FINISHED_ABORTED and sched.kv.num_free_blocks == 8
    assert sched.finished_req_ids == {"a", "b"}
