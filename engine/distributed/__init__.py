"""Tensor parallelism's process group: the ranks that share one model and their collectives (parallel_state).
The worker processes that hold ranks 1..N-1 are the executor's (engine/executor/)."""
