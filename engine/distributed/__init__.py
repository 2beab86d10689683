"""Tensor parallelism: the process group of the ranks that share one model (parallel_state) and the worker
processes that hold ranks 1..N-1."""
