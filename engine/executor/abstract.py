"""The executor's interface: start the ranks' workers, run each step on all of them, stop them. A step goes in as
a SchedulerOutput (plain data) and comes back as an InflightStep whose result() is the sampled tokens."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.structured_output import Grammar
from engine.worker.inflight import InflightStep
from engine.worker.worker import KVCacheConfig, Worker


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    device: str

    def as_dict(self) -> dict:
        return {"rank": self.rank, "pid": self.pid, "device": self.device}


class Executor(ABC):
    """Owns the workers of every rank. Rank 0's (`driver_worker`) lives in this process: it alone samples, so
    it holds the structured-output matchers (`grammars`, filled by the engine core by request id)."""

    driver_worker: Worker
    ranks: list[RankInfo]

    @staticmethod
    def create(args: EngineArgs, model_config: ModelConfig, device: torch.device, image_processor,
               grammars: dict[str, Grammar]) -> "Executor":
        """The executor for `args.tensor_parallel_size`, its workers started and ready for steps."""
        if args.tensor_parallel_size > 1:
            from engine.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor(args, model_config, device, image_processor, grammars)
        from engine.executor.uniproc import UniProcExecutor
        return UniProcExecutor(args, model_config, device, image_processor, grammars)

    kv_cache_config: KVCacheConfig

    @property
    def dtype(self) -> torch.dtype:
        return self.driver_worker.dtype

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> InflightStep:
        """Launch step `so` on every rank and return rank 0's step at once (its result() waits for the tokens)."""

    def encoder_cache_stats(self) -> dict:
        return self.driver_worker.encoder_cache_stats()

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """callback(message) runs when a rank fails, before the process exits (only other processes fail so)."""

    @abstractmethod
    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: with `graceful`, from the thread that runs the steps, between steps."""


def device_name(device: torch.device) -> str:
    """cuda:0 rather than cuda: the GPU this process runs on, as /stats reports it."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def this_process_rank(device: torch.device) -> RankInfo:
    return RankInfo(0, os.getpid(), device_name(device))
