"""AsyncLLM, the engine thread behind the server: a request queued from the worker that processed its prompt
streams like any other, and one whose client left while its prompt was being processed never runs. The server's
narrow API: tokens encoded and decoded on the input pool under the prompt-text budgets, and engine state read
only by the engine thread."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_helpers import assert_pool_idle

from engine.args import EngineArgs
from engine.async_llm import READ_WAIT_S, AsyncLLM, StartRequest, StatsSnapshot
from engine.errors import InvalidInputError, PayloadTooLargeError, ServerBusyError
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = AsyncLLM(EngineArgs(model=str(qwen3_dir), max_model_len=256, num_gpu_blocks_override=64,
                                 swap_space=0.01))
    yield engine
    engine.shutdown()


def slow_prompts(llm, monkeypatch, seconds: float) -> None:
    real = llm.engine.process_prompt
    monkeypatch.setattr(llm.engine, "process_prompt", lambda p, *args: time.sleep(seconds) or real(p, *args))


def wait_idle(llm, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished_requests()


def test_a_request_started_by_its_prompts_worker_streams_its_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run():
        start = StartRequest("started-1", params)
        prompt = await llm.process_prompt("Hello there", start=start)
        assert "started-1" in llm._streams          # queued before the event loop saw the prompt
        return [out async for out in llm.generate("started-1", prompt, params)]
    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert "started-1" not in llm._streams
    wait_idle(llm)


def test_a_client_gone_while_its_prompt_was_processed_leaves_nothing_running(llm, monkeypatch):
    slow_prompts(llm, monkeypatch, 0.3)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        task = asyncio.create_task(llm.process_prompt("Hello there", start=StartRequest("gone-1", params)))
        await asyncio.sleep(0.05)                    # the worker is inside process_prompt
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)                     # it finishes, starts the request, and the request is dropped
    asyncio.run(run())
    assert "gone-1" not in llm._streams
    wait_idle(llm)
    assert_pool_idle(llm)


def test_prompts_still_queued_when_their_clients_leave_are_never_processed(llm, monkeypatch):
    processed, gate = [], threading.Event()
    real = llm.engine.process_prompt

    def held(p, *args):
        if isinstance(p, str):                        # a prompt's processing (the engine thread passes results)
            processed.append(p)
            gate.wait(10)                             # every worker stays busy until the clients have left
        return real(p, *args)
    monkeypatch.setattr(llm.engine, "process_prompt", held)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    workers = llm._workers._max_workers

    async def run():
        tasks = [asyncio.create_task(llm.process_prompt(f"Hello {i}", start=StartRequest(f"queued-{i}", params)))
                 for i in range(workers + 20)]
        await asyncio.sleep(0.1)                     # the workers are busy; the other prompts wait in the queue
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gate.set()
        await asyncio.sleep(0.5)
    asyncio.run(run())
    assert len(processed) <= workers
    assert not any(rid.startswith("queued-") for rid in llm._streams)
    wait_idle(llm)
    assert_pool_idle(llm)


def test_an_abort_that_comes_during_a_step_is_applied_before_the_next_schedule(llm, monkeypatch):
    """A repetition penalty reads every token id, so the previous step is awaited right before the next is
    scheduled: an abort that arrives while it is awaited still keeps the request out of that next step."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    engine, finishes, after_abort = llm.engine, [], []
    finish, schedule = engine._finish, engine.scheduler.schedule

    def finish_and_abort(step):
        finishes.append(1)
        if len(finishes) == 3:
            llm.abort("penalized")                     # a client leaves while the step's tokens are awaited
            after_abort.append(None)
        return finish(step)

    def recording_schedule():
        so = schedule()
        if after_abort and after_abort[-1] is None:
            after_abort[-1] = set(so.num_scheduled_tokens)
        return so
    monkeypatch.setattr(engine, "_finish", finish_and_abort)
    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)

    async def run():
        prompt = await llm.process_prompt("Hello there")
        async for out in llm.generate("penalized", prompt, params):
            if out.finished:
                return out
    out = asyncio.run(run())
    wait_idle(llm)                                     # the abort's output may come before that next schedule
    assert out.outputs[0].finish_reason == "abort"
    assert after_abort == [set()]
    assert_pool_idle(llm)


def test_thousands_of_queued_and_running_requests_are_aborted_at_once(llm):
    """A burst of disconnects (every client of a full server leaving) frees everything within the step in flight
    and the next: the aborts reach the engine as one batch (test_core_scheduler times the batch itself), and no
    stream, block or runner state is left behind. The bound allows two steps of 64 sequences on a busy 2-core
    machine."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompt = llm.engine.process_prompt({"prompt_token_ids": [5, 6, 7]})
    ids = [f"burst-{i}" for i in range(llm.max_pending)]

    async def run() -> float:
        loop = asyncio.get_running_loop()
        for rid in ids:
            llm.start_request(rid, prompt, params, 0, loop)
        deadline = time.monotonic() + 60
        while len(llm.engine.scheduler.requests) < len(ids) or llm.engine.stats.snapshot()["num_running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert len(llm.engine.scheduler.waiting) > 3000         # most wait; the pool holds the running ones
        start = time.monotonic()
        for rid in reversed(ids):                               # the newest first: each is at the far end
            llm.release(rid)
        while llm.engine.has_unfinished_requests():
            await asyncio.sleep(0.005)
        return time.monotonic() - start
    assert asyncio.run(run()) < 5.0
    assert not llm._streams
    assert_pool_idle(llm)


# ---- the narrow API the server uses ----------------------------------------------------------------------------
def test_encode_and_decode_run_on_the_input_pool(llm, monkeypatch):
    threads = []
    tokenize = llm.engine.input_processor.tokenize
    monkeypatch.setattr(llm.engine.input_processor, "tokenize",
                        lambda *a: threads.append(threading.current_thread().name) or tokenize(*a))

    async def run():
        ids = await llm.encode("Hello cat", add_special_tokens=False)
        return ids, await llm.decode(ids), await llm.convert_ids_to_tokens(ids)
    ids, text, symbols = asyncio.run(run())
    assert ids == llm.engine.tokenizer.encode("Hello cat", add_special_tokens=False)
    assert text == "Hello cat" and symbols == llm.engine.tokenizer.convert_ids_to_tokens(ids)
    assert threads and threads[0].startswith("input")


def test_encode_meets_the_prompt_text_budgets_of_a_prompt(llm):
    """Past the per-request cap a 413 before anything is tokenized; beside other text in flight a 429."""
    ip = llm.engine.input_processor
    with pytest.raises(PayloadTooLargeError) as too_large:
        asyncio.run(llm.encode("x" * (ip.limits.max_prompt_text_bytes + 1)))
    assert too_large.value.code == "prompt_text_too_large" and too_large.value.status == 413
    with ip.text_budget.hold(ip.limits.max_prompt_text_bytes_in_flight):      # other requests' text
        with pytest.raises(ServerBusyError) as busy:
            asyncio.run(llm.encode("Hello"))
    assert busy.value.code == "text_budget_exceeded" and busy.value.status == 429


@pytest.mark.parametrize("bad", [-1, "vocab_size", 1.0, True, "7"])
def test_decode_refuses_anything_but_ids_of_the_vocabulary(llm, bad):
    bad = llm.model_info.vocab_size if bad == "vocab_size" else bad
    with pytest.raises(InvalidInputError) as e:
        asyncio.run(llm.decode([1, bad]))
    assert e.value.param == "tokens" and repr(bad) in e.value.message


def test_uptime_counts_seconds_since_the_engine_started(llm):
    first = llm.get_stats().counters["uptime_s"]
    time.sleep(0.05)
    second = llm.get_stats().counters["uptime_s"]
    assert 0 < first < second < 3600


def test_model_info_describes_the_served_model(llm):
    info = llm.model_info
    assert (info.max_model_len, info.vocab_size) == (256, llm.engine.model_config.vocab_size)
    assert not info.multimodal and not info.demo_model


class OwnedBy:
    """A stand-in for an engine-core object that records the threads reading it."""

    def __init__(self, target, readers: set[str]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_readers", readers)

    def __getattr__(self, name):
        self._readers.add(threading.current_thread().name)
        return getattr(self._target, name)

    def __setattr__(self, name, value):
        setattr(self._target, name, value)


def test_only_the_engine_thread_reads_the_scheduler_and_the_kv_cache(llm, monkeypatch):
    """Admission counts, /stats and /stats/blocks come from what the engine thread publishes between steps."""
    readers: set[str] = set()
    monkeypatch.setattr(llm.engine, "scheduler", OwnedBy(llm.engine.scheduler, readers))
    monkeypatch.setattr(llm.engine, "kv", OwnedBy(llm.engine.kv, readers))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def run():
        prompt = await llm.process_prompt("Hello there")
        stream = llm.generate("owned-1", prompt, params)
        await anext(stream)
        stats, blocks = llm.get_stats(), await llm.get_block_map()
        llm.admission_stats()
        async for _ in stream:
            pass
        return stats, blocks
    stats, blocks = asyncio.run(run())
    assert stats.counters["num_running"] == 1 and stats.iteration_tokens.count >= 1
    assert [r["id"] for r in blocks["requests"]] == ["owned-1"]
    assert readers == {"engine-loop"}
    wait_idle(llm)


def test_reads_during_a_long_step_answer_from_the_last_copies(llm, monkeypatch):
    """A step that holds the engine thread (a long prefill on the CPU) holds neither /stats, answered at once from
    the counters copied after the last step or command, nor /stats/blocks, answered after READ_WAIT_S from the
    block map copied last."""
    asyncio.run(llm.get_block_map())                    # a fresh copy while idle
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda **kw: time.sleep(4 * READ_WAIT_S) or step(**kw))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run() -> tuple[float, StatsSnapshot, float, dict]:
        prompt = await llm.process_prompt("Hello there")
        stream = llm.generate("slow-1", prompt, params)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.2)                         # the engine thread is inside the slow step
        start = time.monotonic()
        stats = llm.get_stats()
        stats_s = time.monotonic() - start
        blocks = await llm.get_block_map()
        blocks_s = time.monotonic() - start - stats_s
        await first
        async for _ in stream:
            pass
        return stats_s, stats, blocks_s, blocks
    stats_s, stats, blocks_s, blocks = asyncio.run(run())
    assert stats_s < 0.05 and (stats.counters["num_running"], stats.counters["num_waiting"]) == (0, 1)
    assert READ_WAIT_S <= blocks_s < 3 * READ_WAIT_S and blocks["requests"] == []
    wait_idle(llm)
