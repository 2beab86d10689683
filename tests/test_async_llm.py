"""AsyncLLM, the engine thread behind the server: a request queued from the worker that processed its prompt
streams like any other, and one whose client left while its prompt was being processed never runs."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine_helpers import assert_pool_idle

from engine.args import EngineArgs
from engine.async_llm import AsyncLLM, StartRequest
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = AsyncLLM(EngineArgs(model=str(qwen3_dir), max_model_len=256, num_gpu_blocks_override=64,
                                 swap_space=0.01))
    yield engine
    engine.shutdown()


def slow_prompts(llm, monkeypatch, seconds: float) -> None:
    real = llm.engine.process_prompt
    monkeypatch.setattr(llm.engine, "process_prompt", lambda p: time.sleep(seconds) or real(p))


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
