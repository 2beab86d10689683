"""TP=1: the one worker, in the engine process (vLLM's UniProcExecutor)."""
from __future__ import annotations

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.executor.abstract import Executor, this_process_rank
from engine.structured_output import Grammar
from engine.worker.inflight import InflightStep
from engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs, model_config: ModelConfig, device: torch.device, image_processor,
                 grammars: dict[str, Grammar]):
        self.driver_worker = Worker(args, model_config, device, image_processor, grammars)
        self.kv_cache_config = self.driver_worker.initialize()
        self.ranks = [this_process_rank(device)]

    def execute_model(self, so: SchedulerOutput) -> InflightStep:
        return self.driver_worker.execute_model(so)

    def shutdown(self, graceful: bool = True) -> None:
        pass          # the worker lives and ends with this process
