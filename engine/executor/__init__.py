"""How the engine core reaches its workers (vLLM v1's executor): one in-process worker at TP=1
(UniProcExecutor), rank 0's worker plus N-1 worker processes above it (MultiprocExecutor). LLMEngine holds one
executor and never touches a worker, the runner, the KV cache or the model itself."""
from engine.executor.abstract import Executor, RankInfo
from engine.worker.inflight import InflightStep, StepResult
from engine.worker.worker import KVCacheConfig

__all__ = ["Executor", "InflightStep", "KVCacheConfig", "RankInfo", "StepResult"]
