"""Tensor parallelism end to end, on the CPU over gloo: `LLM(tensor_parallel_size=N)` gives the tokens of TP=1.

Each case runs one workload (text and images, greedy, seeded sampling, a repetition penalty, prompt logprobs,
requests arriving at staggered steps) twice with the same engine settings, at TP=1 and at TP=N, with chunked
prefill, preemption (swap or recompute) from a tiny KV pool and prefix caching on; the tokens must be identical.
Failures run the server in a subprocess: a killed worker ends the engine within seconds with one clear line, a
killed engine process takes its workers with it. Bad sizes are refused before any process starts.

Every TP engine spawns N-1 processes that import torch (seconds each on a small machine), so the cases are few
and each runs its whole workload on one engine.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time

import psutil
import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.executor.multiproc import check_tensor_parallel_size
from engine.errors import ModelLoadError
from engine.model.loader import load_model_config
from engine.sampling_params import StructuredOutputsParams
from engine.server.cli import parse_args
from engine_helpers import assert_pool_idle, make_llm, noise_image
from servers import SERVED_NAME, http, start_engine
from test_engine_parity import image_part

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)
SCORED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)

TEXT = [
    [{"role": "user", "content": "Hello! How can I help you today?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Once upon a time there was a small cat who liked to sleep in the sun."}],
    [{"role": "user", "content": "The capital of France is Paris. The capital of Italy is"}],
]
IMAGES = [
    [{"role": "user", "content": [image_part(noise_image(64, 64, 10)), {"type": "text", "text": "Describe it."}]}],
    [{"role": "user", "content": [image_part(noise_image(96, 160, 11)), {"type": "text", "text": "and"},
                                  image_part(noise_image(64, 128, 12)), {"type": "text", "text": "Compare."}]}],
]
# A tiny pool (preemption), a small token budget (chunked prefill) and the prefix cache, in every case.
TIGHT = dict(num_gpu_blocks_override=10, max_num_batched_tokens=13, enable_prefix_caching=True)
SWAP, RECOMPUTE = dict(swap_space=0.01), dict(swap_space=0)

CASES = {
    "qwen3-vl, TP=2, swap": ("qwen3_vl_dir", 2, SWAP),
    "qwen3-vl, TP=4 (KV heads replicated), recompute": ("qwen3_vl_dir", 4, RECOMPUTE),
    "qwen3, TP=4, swap": ("qwen3_dir", 4, SWAP),
    # Each rank caches its KV heads in fp8; a K/V value rounds to the same e4m3 code as at TP=1.
    "qwen3-vl, TP=2, swap, fp8 KV cache": ("qwen3_vl_dir", 2, dict(SWAP, kv_cache_dtype="fp8")),
    "llama, TP=2, recompute": ("llama_dir", 2, RECOMPUTE),
    # Each rank quantizes its vocabulary rows; the groups run along the hidden size, so the codes are TP=1's.
    "llama, TP=2, recompute, 8-bit lm_head": ("llama_dir", 2, dict(RECOMPUTE, quantize_lm_head=True)),
    # Verify steps: rank 0 samples and the workers never wait on token ids (no input of the next step is pending).
    "qwen3-vl, TP=2, swap, n-gram speculative decoding": ("qwen3_vl_dir", 2, dict(SWAP, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})),
}


def run_workload(llm: LLM, with_images: bool) -> list:
    """Every request's output, one new request per step (greedy, seeded, penalized, constrained to a choice, with
    logprobs); then one prompt twice more, alone (prefix-cache hits whatever the tiny pool evicted meanwhile)."""
    engine = llm.engine
    prompts = [engine.input_processor.process_chat(c) for c in TEXT + (IMAGES if with_images else [])]
    # The grammar lives on rank 0 only (the workers receive the tokens it allowed); compiled per engine.
    choice = SamplingParams(temperature=1.0, seed=5, max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=["red", "green", "blue and yellow"]))
    work = [(p, GREEDY) for p in prompts] + [(prompts[1], SEEDED), (prompts[0], PENALIZED), (prompts[0], choice),
                                             (prompts[2], SCORED)]
    pending = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(work)]
    final = {}
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    again = [llm.generate(prompts[1], GREEDY)[0] for _ in range(2)]
    assert_pool_idle(llm)
    return again + [final[f"r{i}"] for i in range(len(work))]


def assert_same_outputs(got, expected) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    scored, reference = got[-1], expected[-1]
    for entry, ref in zip(scored.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert entry.keys() == ref.keys()
        assert all(abs(entry[t] - ref[t]) < 1e-3 for t in ref)
    for entry, ref in zip(scored.outputs[0].logprobs, reference.outputs[0].logprobs):
        assert all(abs(entry[t] - ref[t]) < 1e-3 for t in ref)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_gives_the_tokens_of_one_rank(case, request):
    fixture, tp, preemption = CASES[case]
    model_dir = request.getfixturevalue(fixture)
    with_images = fixture == "qwen3_vl_dir"
    expected = run_workload(make_llm(model_dir, **TIGHT, **preemption), with_images)

    llm = make_llm(model_dir, tensor_parallel_size=tp, **TIGHT, **preemption)
    workers = llm.engine.model_executor.workers
    try:
        got = run_workload(llm, with_images)
        stats = llm.engine.get_stats()
        with pytest.raises(ModelLoadError, match="this process already runs a tensor-parallel engine"):
            make_llm(model_dir, tensor_parallel_size=2)       # one group per process: refused before spawning
        assert set(multiprocessing.active_children()) == set(workers)
    finally:
        llm.shutdown()
    assert_same_outputs(got, expected)
    assert got[-2].outputs[0].text in ("red", "green", "blue and yellow")
    # The workload exercised what it is meant to.
    assert stats["tensor_parallel_size"] == tp
    assert [r["rank"] for r in stats["ranks"]] == list(range(tp))
    assert [r["pid"] for r in stats["ranks"]] == [os.getpid()] + [p.pid for p in workers]
    assert stats["num_swap_outs" if preemption.get("swap_space") else "num_recompute_preemptions"] > 0
    assert stats["kv_cache_dtype"] == ("float8_e4m3fn" if "kv_cache_dtype" in preemption else "float32")
    assert stats["prefix_cache_hits"] > 0
    if "speculative_config" in preemption:
        assert stats["spec_decode"]["num_accepted_tokens"] > 0
    # Shut down cleanly: every worker left its loop and exited 0, none is left behind.
    assert [p.exitcode for p in workers] == [0] * (tp - 1)
    assert not multiprocessing.active_children()


def test_one_rank_is_the_engine_process_alone(qwen3_dir):
    """TP=1 (the default) starts no process and sends nothing: one in-process worker, no group."""
    from engine.distributed.parallel_state import get_tp_size
    from engine.executor.uniproc import UniProcExecutor

    before = psutil.Process().children(recursive=True)
    llm = make_llm(qwen3_dir)
    executor = llm.engine.model_executor
    assert isinstance(executor, UniProcExecutor) and get_tp_size() == 1
    assert executor.driver_worker.model_runner.tp_size == 1
    assert psutil.Process().children(recursive=True) == before
    stats = llm.engine.get_stats()
    assert stats["tensor_parallel_size"] == 1
    assert stats["ranks"] == [{"rank": 0, "pid": os.getpid(), "device": "cpu"}]


# ---- bad sizes: refused before any process starts ------------------------------------------------------------
def test_a_size_below_one_is_refused():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineArgs(model="m", tensor_parallel_size=bad)


def test_the_flag_and_its_short_form():
    assert parse_args(["--model", "m", "--tensor-parallel-size", "2"])[0].tensor_parallel_size == 2
    assert parse_args(["--model", "m", "-tp", "4"])[0].tensor_parallel_size == 4
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "-tp", "0"])


def test_a_size_that_does_not_divide_the_heads_is_refused_without_starting_workers(qwen3_dir):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size 3 does not fit this model: it does not divide "
                                             r"the 4 attention heads.*\(sizes that fit: 1, 2, 4\)") as err:
        LLM(str(qwen3_dir), tensor_parallel_size=3, num_gpu_blocks_override=16, max_model_len=256)
    assert err.value.code == "tensor_parallel"
    assert psutil.Process().children(recursive=True) == before


def test_more_ranks_than_visible_gpus_is_refused(qwen3_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = load_model_config(str(qwen3_dir), None, "auto")
    with pytest.raises(ModelLoadError, match=r"--tensor-parallel-size 4 needs 4 GPUs, one per rank, but 2 are "
                                             r"visible \(CUDA_VISIBLE_DEVICES=0,1\)"):
        check_tensor_parallel_size(4, torch.device("cuda"), config)
    check_tensor_parallel_size(2, torch.device("cuda"), config)        # as many as there are: fine
    check_tensor_parallel_size(4, torch.device("cpu"), config)         # on CPU, any N the heads allow


# ---- what travels to the workers ------------------------------------------------------------------------------
def test_a_step_travels_to_the_workers_as_plain_data(qwen3_vl_dir):
    """A SchedulerOutput pickles as it is: the prompt, its images' uint8 pixels and the sampling parameters
    travel; the compiled constraint (a cache of rank 0's engine core) does not, and rank 0's copy keeps it."""
    llm = make_llm(qwen3_vl_dir)
    prompt = llm.engine.input_processor.process_chat(IMAGES[0])
    params = SamplingParams(seed=3, prompt_logprobs=1, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    params.structured_outputs.compiled = object()          # stands for llguidance's compiled grammar
    new = NewRequestData("r0", prompt, params, {1})
    step = ScheduledRequest("r0", 8, 0, prompt.prompt_token_ids[:8], [0])
    so = SchedulerOutput(scheduled_new_reqs=[new], scheduled=[step], num_scheduled_tokens={"r0": 8})

    sent = pickle.loads(pickle.dumps(so))
    [got] = sent.scheduled_new_reqs
    assert got.sampling_params.structured_outputs.regex == "[ab]+"
    assert got.sampling_params.structured_outputs.compiled is None
    assert got.sampling_params.prompt_logprobs == 1 and got.sampling_params.seed == 3
    assert got.prompt.prompt_token_ids == prompt.prompt_token_ids
    assert torch.equal(got.prompt.images[0].raw, prompt.images[0].raw)
    assert torch.equal(got.prompt.mrope_positions, prompt.mrope_positions)
    assert sent.scheduled[0].block_ids == [0] and sent.num_scheduled_tokens == {"r0": 8}
    assert params.structured_outputs.compiled is not None


# ---- an idle engine ------------------------------------------------------------------------------------------
def _wait_for_a_late_step(port: int) -> object:
    """On each rank: a group whose collectives time out after 1 s, whose host group waits as the executor's
    does; rank 0 sends its "step" only after 2.5 s."""
    from engine.executor.multiproc import STEP_WAIT_TIMEOUT_S
    from engine.distributed.parallel_state import (broadcast_object, destroy_tensor_parallel, get_tp_rank,
                                                   init_tensor_parallel)
    rank = get_tp_rank()
    destroy_tensor_parallel()          # the harness's group; this one has the short collective timeout
    init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=1.0,
                         object_timeout_s=STEP_WAIT_TIMEOUT_S)
    if rank == 0:
        time.sleep(2.5)
    return broadcast_object("step" if rank == 0 else None)


@pytest.mark.slow
def test_workers_wait_for_the_next_step_however_long_the_engine_idles():
    """The workers wait for each step in a broadcast on the host group: an idle engine must not time it out."""
    from tp_helpers import free_port, run_tensor_parallel

    assert run_tensor_parallel(_wait_for_a_late_step, 2, free_port(), timeout_s=60) == ["step", "step"]


# ---- failures: the server in a subprocess -------------------------------------------------------------------
SERVER_ARGS = ("--tensor-parallel-size", "2", "--device", "cpu", "--num-gpu-blocks-override", "80",
               "--max-model-len", "1024", "--enforce-eager")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_killed_worker_ends_the_engine_with_one_clear_line(qwen3_dir, tmp_path):
    server = start_engine(qwen3_dir, tmp_path, extra_args=SERVER_ARGS)
    try:
        status, stats = http("GET", server.url + "/stats")
        assert status == 200 and stats["tensor_parallel_size"] == 2
        rank0, rank1 = stats["ranks"]
        assert (rank0["rank"], rank0["pid"], rank0["device"]) == (0, server.proc.pid, "cpu")
        assert rank1["rank"] == 1 and rank1["device"] == "cpu"
        assert f"Tensor parallel size 2: rank 0 pid {server.proc.pid} on cpu, rank 1 pid {rank1['pid']} on cpu" \
            in server.log_text()
        status, body = http("POST", server.url + "/v1/completions",
                            {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                             "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 4

        # Killed mid-generation: rank 0's own collectives fail too, but the dead worker is what is reported.
        long = threading.Thread(target=http, daemon=True, args=("POST", server.url + "/v1/completions", {
            "model": SERVED_NAME, "prompt": "Count", "max_tokens": 1000, "ignore_eos": True}))
        long.start()
        deadline = time.monotonic() + 30
        while http("GET", server.url + "/stats")[1]["num_generation_tokens"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http("GET", server.url + "/stats")[1]["num_running"] == 1
        os.kill(rank1["pid"], signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=15)
        elapsed = time.monotonic() - start
        long.join(5)
    finally:
        if server.alive():
            server.stop()
    assert code == 1
    assert elapsed < 5
    assert not long.is_alive(), "the client's request outlived the engine"
    log = server.log_text()
    line = "tensor-parallel worker rank 1 exited with code -9 (killed by SIGKILL)"
    assert log.count(line) == 1 and log.count(f"tensor-parallel worker rank 1 was pid {rank1['pid']}") == 1
    assert "rank 0 failed" not in log


@pytest.mark.slow
def test_a_stopped_server_stops_its_workers_cleanly(qwen3_dir, tmp_path):
    """SIGTERM to the whole process group, as the launcher's stop sends it: the workers leave it to rank 0,
    which shuts down (exit 0) and ends them between steps; nothing is reported as a failure."""
    server = start_engine(qwen3_dir, tmp_path, extra_args=SERVER_ARGS)
    try:
        _, stats = http("GET", server.url + "/stats")
        worker_pid = stats["ranks"][1]["pid"]
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(20) == 0
        assert wait_gone(worker_pid, 5)
    finally:
        if server.alive():
            server.stop()
    assert "Shutting down" in server.log_text()
    assert "tensor-parallel worker" not in server.log_text()


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_is_killed(qwen3_dir, tmp_path):
    server = start_engine(qwen3_dir, tmp_path, extra_args=SERVER_ARGS)
    try:
        _, stats = http("GET", server.url + "/stats")
        worker_pid = stats["ranks"][1]["pid"]
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)
        assert wait_gone(worker_pid, 5), "the worker outlived its engine process"
    finally:
        if server.alive():
            server.stop()
