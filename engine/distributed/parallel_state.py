"""The tensor-parallel group of this process, and the collectives the model and the runner use.

One engine process is rank 0; `--tensor-parallel-size N` adds N-1 worker processes. Every rank calls
`init_tensor_parallel` once before building its model. Without it (TP=1) the rank is 0 of 1 and every collective
returns its input: the single-device engine runs the same code with no process group at all.

Two groups: the device group (NCCL on CUDA, gloo on CPU) carries tensors inside the forward pass; a gloo group
on the host carries Python objects (the scheduler's output, start-up facts) so that pickled data never goes
through NCCL.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    device_group: object | None      # torch.distributed ProcessGroup, None at TP=1
    cpu_group: object | None


_TP = TensorParallelGroup(rank=0, world_size=1, device_group=None, cpu_group=None)


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device,
                         timeout_s: float = 600.0, object_timeout_s: float | None = None) -> TensorParallelGroup:
    """Join the group of `world_size` ranks at `init_method` (e.g. tcp://127.0.0.1:port). `object_timeout_s`:
    a longer wait for the host group, whose broadcasts the workers wait in while the engine is idle."""
    global _TP
    if world_size == 1:
        _TP = TensorParallelGroup(0, 1, None, None)
        return _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    ranks = list(range(world_size))
    if backend == "gloo" and object_timeout_s is None:
        cpu_group = dist.group.WORLD
    else:
        object_timeout = timeout if object_timeout_s is None else datetime.timedelta(seconds=object_timeout_s)
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=object_timeout)
    _TP = TensorParallelGroup(rank, world_size, dist.group.WORLD, cpu_group)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelGroup(0, 1, None, None)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (row-parallel layers' partial outputs). In place; returns x."""
    if _TP.world_size > 1:
        dist.all_reduce(x, group=_TP.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated along `dim`, rank order (column-parallel outputs, vocab-parallel logits)."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_tensor(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """x from rank `src` into every rank's x (same shape and dtype on every rank). In place; returns x."""
    if _TP.world_size > 1:
        dist.broadcast(x, src=src, group=_TP.device_group)
    return x


def broadcast_object(obj: object = None, src: int = 0) -> object:
    """A picklable object from rank `src` to every rank, over the host group: rank src passes it, the others
    pass nothing and get it back."""
    if _TP.world_size == 1:
        return obj
    box = [obj if _TP.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=_TP.cpu_group)
    return box[0]


def all_gather_object(obj: object) -> list:
    """Every rank's obj, in rank order, over the host group (start-up facts such as free memory)."""
    if _TP.world_size == 1:
        return [obj]
    out = [None] * _TP.world_size
    dist.all_gather_object(out, obj, group=_TP.cpu_group)
    return out
