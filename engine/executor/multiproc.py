"""Tensor parallelism's executor (vLLM's MultiprocExecutor): rank 0's worker in this process, ranks 1..N-1 in
processes it starts, sends each step, watches and stops.

`--tensor-parallel-size N` makes the engine process rank 0 (scheduler, KV cache manager, tokenizer, HTTP, and its
own share of the model) and spawns ranks 1..N-1 (engine/executor/worker_proc.py). Every step, rank 0 broadcasts
the SchedulerOutput (plain data) over the host group; each worker launches the same step on its runner, and the
model's collectives keep the ranks in lockstep.

A rank that dies leaves the others blocked in a collective that cannot be interrupted safely (NCCL waits until
its timeout), so the failure is handled from outside the step: a watcher thread sees the worker's exit, logs one
line, fails the open requests (callbacks), stops the other workers and ends the engine process with exit code 1.
A worker whose engine process dies exits by itself (it polls its parent).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.errors import ModelLoadError
from engine.executor.abstract import Executor, RankInfo
from engine.logger import init_logger
from engine.structured_output import Grammar
from engine.worker.inflight import InflightStep
from engine.worker.worker import Worker

logger = init_logger(__name__)

# The workers wait for the next step inside a broadcast on the host group, however long the engine stays idle;
# a rank that dies is noticed by the watchers (here and in each worker), not by this timeout.
STEP_WAIT_TIMEOUT_S = 10 * 365 * 24 * 3600.0
JOIN_TIMEOUT_S = 5.0           # a worker told to stop has this long before it is killed
FAILURE_GRACE_S = 1.0          # after a rank failure: time for the open streams' error events to go out
WORKER_EXIT_WAIT_S = 2.0       # rank 0's step failed: how long to look for a dead worker behind it


def check_tensor_parallel_size(n: int, device: torch.device, config: ModelConfig) -> None:
    """Refuse an N that cannot run, before any process is started: a second group in this process, more ranks
    than visible GPUs, or a model whose shape does not split into N shares (ModelConfig.verify_tensor_parallel)."""
    if n == 1:
        return
    from engine.distributed.parallel_state import get_tp_size
    if get_tp_size() > 1:
        raise ModelLoadError("this process already runs a tensor-parallel engine (one group per process); shut it "
                             "down first (LLM.shutdown())", param="tensor_parallel_size", code="tensor_parallel")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if n > visible:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
            raise ModelLoadError(f"--tensor-parallel-size {n} needs {n} GPUs, one per rank, but {visible} "
                                 f"{'is' if visible == 1 else 'are'} visible{where}; lower it to at most "
                                 f"{visible}", param="tensor_parallel_size", code="tensor_parallel")
    config.verify_tensor_parallel(n)


class MultiprocExecutor(Executor):
    """Spawns ranks 1..N-1, joins the group as rank 0, builds rank 0's worker, and owns the workers until
    shutdown()."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device: torch.device, image_processor,
                 grammars: dict[str, Grammar]):
        from engine.distributed.parallel_state import init_tensor_parallel
        from engine.executor.worker_proc import run_worker

        check_tensor_parallel_size(args.tensor_parallel_size, device, model_config)   # before any process starts
        n = self.world_size = args.tensor_parallel_size
        # NVLink multicast (NVLS) stays off: NCCL reads it when it starts, in every rank (inherited).
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads, self._threads_before = None, torch.get_num_threads()
        if device.type == "cpu":       # N ranks share the cores: oversubscribed threads slow every collective
            threads = max(1, self._threads_before // n)
            torch.set_num_threads(threads)
        log_files = [h.baseFilename for h in logging.getLogger("engine").handlers
                     if isinstance(h, logging.FileHandler)]
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers = [ctx.Process(target=run_worker, name=f"tp-worker-{rank}", daemon=True,
                                    args=(rank, n, init_method, args, device.type, os.getpid(), log_files, threads))
                        for rank in range(1, n)]
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._closing = threading.Event()     # shutting down or failed: a worker's exit is expected
        self._fail_lock = threading.Lock()
        self._ready = False           # the workers are (or are about to be) in their step loop
        self.failure: str | None = None
        self._stop_r, self._stop_w = os.pipe()
        for p in self.workers:
            p.start()
        atexit.register(self.shutdown, graceful=False)   # before multiprocessing's own exit handler runs
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        rank0_device = device if device.type == "cpu" else torch.device("cuda", 0)
        self.ranks = [RankInfo(0, os.getpid(), str(rank0_device))] + [
            RankInfo(r, p.pid, "cpu" if device.type == "cpu" else f"cuda:{r}")
            for r, p in enumerate(self.workers, start=1)]
        logger.info("Tensor parallel size %d: %s", n, ", ".join(f"rank {r.rank} pid {r.pid} on {r.device}"
                                                              for r in self.ranks))
        try:
            if rank0_device.type == "cuda":
                torch.cuda.set_device(rank0_device)
            init_tensor_parallel(0, n, init_method, rank0_device, object_timeout_s=STEP_WAIT_TIMEOUT_S)
            self.driver_worker = Worker(args, model_config, rank0_device, image_processor, grammars)
            self.kv_cache_config = self.driver_worker.initialize()
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self._ready = True            # from now on the workers wait in their step loop

    # ---- steps ---------------------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> InflightStep:
        """Send step `so` to the workers, then launch it here. From the send on, every rank must run the step's
        collectives: rank 0 failing inside the step leaves the others waiting in one, so it ends the engine."""
        from engine.distributed.parallel_state import broadcast_object
        try:
            broadcast_object(so)
            return self.driver_worker.execute_model(so)
        except Exception as e:
            self.step_failed(e)       # ends the process, unless it is already shutting down
            raise

    # ---- failure -------------------------------------------------------------------------------------------
    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """callback(message) runs on the watcher thread when a rank fails, before the process exits."""
        self._failure_callbacks.append(callback)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._stop_r])
        if self._closing.is_set():
            return
        rank, proc = next(sentinels[s] for s in ready if s in sentinels)
        proc.join(1.0)                   # its exit code, once the process is reaped
        hint = "" if self._ready else (
            " while starting (its error is above; a script that starts a tensor-parallel LLM must guard its entry "
            "point with `if __name__ == \"__main__\":`, as the workers are spawned processes that import it)")
        logger.error("tensor-parallel worker rank %d was pid %d", rank, proc.pid)   # the log's, not the clients'
        self.fail(f"tensor-parallel worker rank {rank} exited with code {_describe_exit(proc.exitcode)}{hint}; the "
                  f"engine stops")

    def step_failed(self, error: BaseException) -> None:
        """Rank 0 raised inside a step the workers had received: they may wait in one of its collectives forever.
        A worker that died is the likelier cause (rank 0's collectives fail with it): then the watcher reports
        that worker and ends the process; otherwise rank 0's own error is the reason."""
        deadline = time.monotonic() + WORKER_EXIT_WAIT_S
        while time.monotonic() < deadline and not self._closing.is_set() and self._all_alive():
            time.sleep(0.05)
        if self._closing.is_set() or not self._all_alive():
            self._watcher.join()      # it reports the worker and ends the process (or returns: shutting down)
            return
        logger.error("tensor-parallel rank 0 failed inside a step", exc_info=error)
        self.fail(f"tensor-parallel rank 0 failed inside a step ({type(error).__name__}: {error}); the ranks are "
                  f"out of step, the engine stops")

    def _all_alive(self) -> bool:
        return all(p.exitcode is None for p in self.workers)

    def fail(self, message: str) -> None:
        """A rank is gone or out of step: the others may be blocked in a collective forever. Log once, fail the
        open requests, stop the workers and end this process (exit code 1) so that a supervisor restarts it."""
        with self._fail_lock:                 # the watcher and the engine thread may both get here
            if self._closing.is_set():
                return
            self._closing.set()
        self.failure = message
        logger.error(message)
        for callback in self._failure_callbacks:
            try:
                callback(message)
            except Exception:            # noqa: BLE001 - the exit below must happen whatever a callback does
                logger.exception("tensor-parallel failure callback raised")
        self._kill_workers()
        time.sleep(FAILURE_GRACE_S)
        os._exit(1)

    # ---- shutdown ------------------------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: with `graceful` (from the thread that runs the steps, between steps) they leave their
        loop and close their group; otherwise, or if they do not exit in time, they are killed."""
        with self._fail_lock:
            if self._closing.is_set():
                return
            self._closing.set()
        os.write(self._stop_w, b"x")
        from engine.distributed.parallel_state import broadcast_object, destroy_tensor_parallel
        if graceful and self._ready:
            try:
                broadcast_object(None)
            except Exception as e:       # noqa: BLE001 - a worker already gone: terminate the rest below
                logger.warning("could not tell the tensor-parallel workers to stop: %s", e)
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for p in self.workers:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        destroy_tensor_parallel()
        torch.set_num_threads(self._threads_before)
        atexit.unregister(self.shutdown)
        self._watcher.join(1.0)
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _kill_workers(self) -> None:
        """SIGKILL: workers ignore SIGINT and SIGTERM (run_worker), which reach the engine's whole process group
        on Ctrl-C or a launcher's stop; rank 0 alone decides when they stop."""
        for p in self.workers:
            if p.is_alive():
                p.kill()
        for p in self.workers:
            p.join(2.0)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
