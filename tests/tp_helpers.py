"""Running a function on N tensor-parallel ranks in spawned CPU processes (gloo), for tests.

`run_tensor_parallel(fn, n, *args)` starts N processes on a free TCP port; each joins the group
(init_tensor_parallel), runs fn(*args) and sends back its picklable result. The results come back in rank order.
Whatever happens (an exception on one rank, a rank that dies, a collective that never completes), every process
is ended and the call returns or raises within `timeout_s`: a bug fails the test, it never hangs pytest.
`fn` must be importable by name (a module-level function), as spawn pickles it by reference.
"""
from __future__ import annotations

import contextlib
import pickle
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


class RankError(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, fn, args, results) -> None:
    import torch

    from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)   # N ranks share the machine's cores
    try:
        init_tensor_parallel(rank, world_size, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=timeout_s)
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that die with the rank.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            destroy_tensor_parallel()


def run_tensor_parallel(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """fn(*args) on each of `world_size` ranks; their results in rank order. Raises RankError with the first
    failing rank's traceback, or when a rank exits without a result, or at the timeout."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, timeout_s, fn, args, results),
                         daemon=True, name=f"tp-rank-{rank}") for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, object] = {}
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"{dead[0].name} exited with code {dead[0].exitcode} without a result")
                if time.monotonic() > deadline:
                    raise RankError(f"tensor-parallel run of {fn.__name__} timed out after {timeout_s:.0f} s "
                                    f"(ranks without a result: {sorted(set(range(world_size)) - set(got))})")
                continue
            if not ok:
                raise RankError(f"rank {rank} of {world_size} failed:\n{value}")
            got[rank] = pickle.loads(value)
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(got) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
