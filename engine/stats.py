"""Engine counters for /stats, /metrics and the periodic vLLM-style throughput line in the log."""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.core.scheduler_output import SchedulerOutput
from engine.kv_map import block_map
from engine.logger import init_logger

logger = init_logger(__name__)
LOG_INTERVAL_S = 5.0
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # vLLM's


@dataclass
class Histogram:
    """A Prometheus histogram's state: observations per bucket, their sum and count."""
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)      # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*map(repr, map(float, self.buckets)), "+Inf"), self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out += [f"{name}_sum{{{labels}}} {float(self.total)!r}", f"{name}_count{{{labels}}} {self.count}"]
        return out


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class StatLogger:
    def __init__(self, engine):
        self.engine = engine
        self.started = time.monotonic()     # uptime_s: the clock a reader differentiates the token counters by
        self.num_prompt_tokens = 0          # prefill tokens computed (recomputation included)
        self.num_generation_tokens = 0
        self.num_steps = 0
        self._last_log = time.time()
        self._interval_prompt = 0
        self._interval_gen = 0
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)   # tokens computed per engine step

    def on_schedule(self, so: SchedulerOutput) -> None:
        """Prefill tokens are every scheduled token except single-token steps past the prompt (decodes)."""
        requests = self.engine.scheduler.requests
        decode = sum(1 for s in so.scheduled if s.num_scheduled_tokens == 1
                     and s.num_computed_tokens >= requests[s.request_id].num_prompt_tokens)
        prompt = so.total_num_scheduled_tokens - decode
        self.num_prompt_tokens += prompt
        self._interval_prompt += prompt
        self.num_steps += 1
        self.iteration_tokens.observe(so.total_num_scheduled_tokens)

    def on_spec_decode(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.spec_num_drafts = getattr(self, "spec_num_drafts", 0) + 1
        self.spec_num_draft_tokens = getattr(self, "spec_num_draft_tokens", 0) + num_draft_tokens
        self.spec_num_accepted_tokens = getattr(self, "spec_num_accepted_tokens", 0) + num_accepted_tokens

    def on_tokens(self, num_generated: int) -> None:
        self.num_generation_tokens += num_generated
        self._interval_gen += num_generated
        now = time.time()
        if now - self._last_log >= LOG_INTERVAL_S:
            self._log(now)

    def _log(self, now: float) -> None:
        dt = now - self._last_log
        self.last_prompt_throughput = self._interval_prompt / dt
        self.last_generation_throughput = self._interval_gen / dt
        s = self.snapshot()
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Swapped: %d reqs, Pending: %d reqs, GPU KV cache usage: %.1f%%, CPU KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%", self.last_prompt_throughput, self.last_generation_throughput,
            s["num_running"], s["num_swapped"], s["num_waiting"], s["gpu_cache_usage"] * 100,
            s["cpu_cache_usage"] * 100, s["prefix_cache_hit_rate"] * 100)
        self._last_log, self._interval_prompt, self._interval_gen = now, 0, 0

    def snapshot(self) -> dict:
        e = self.engine
        kv, sched, counters = e.kv, e.scheduler, e.scheduler.counters
        cfg = e.kv_cache_config
        total, free = cfg.num_gpu_blocks, kv.num_free_blocks
        cpu_total, cpu_free = cfg.num_cpu_blocks, kv.num_free_cpu_blocks
        return {
            "model": e.model_name,
            "block_size": e.args.block_size,
            "bytes_per_block": cfg.bytes_per_block,
            "kv_cache_dtype": str(cfg.cache_dtype).removeprefix("torch."),
            "kv_bytes_per_token": cfg.bytes_per_block // e.args.block_size,
            "num_total_gpu_blocks": total,
            "num_free_gpu_blocks": free,
            "num_used_gpu_blocks": total - free,
            "num_cached_blocks": kv.pool.num_cached_blocks,
            "num_total_cpu_blocks": cpu_total,
            "num_free_cpu_blocks": cpu_free,
            "num_used_cpu_blocks": cpu_total - cpu_free,
            "gpu_cache_usage": (total - free) / total if total else 0.0,
            "cpu_cache_usage": (cpu_total - cpu_free) / cpu_total if cpu_total else 0.0,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_swapped": len(sched.swapped),
            "prefix_caching": kv.enable_caching,
            "prefix_cache_queries": kv.prefix_stats.queries,
            "prefix_cache_hits": kv.prefix_stats.hits,
            "prefix_cache_hit_rate": kv.prefix_stats.hit_rate,
            "num_preemptions": counters.num_preemptions,
            "num_recompute_preemptions": counters.num_recompute_preemptions,
            "num_swaps": counters.num_swap_outs + counters.num_swap_ins,
            "num_swap_outs": counters.num_swap_outs,
            "num_swap_ins": counters.num_swap_ins,
            "num_blocks_swapped_out": counters.num_blocks_swapped_out,
            "num_blocks_swapped_in": counters.num_blocks_swapped_in,
            **e.model_executor.encoder_cache_stats(),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_steps": self.num_steps,
            "prompt_throughput": self.last_prompt_throughput,
            "generation_throughput": self.last_generation_throughput,
            "uptime_s": time.monotonic() - self.started,
            "max_model_len": e.max_model_len,
            "max_num_seqs": e.args.max_num_seqs,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "multimodal": e.model_config.is_multimodal,
            "max_images_per_prompt": e.input_processor.limits.limit_images_per_prompt,
            "demo_model": e.args.demo_model,
            "tensor_parallel_size": e.tensor_parallel_size,
            "ranks": [r.as_dict() for r in e.ranks],
        }

    def block_snapshot(self) -> dict:
        """GET /stats/blocks: snapshot() with the block map read right after it (engine/kv_map.py). The map's
        counts, taken from one copy of the block tables, replace snapshot()'s pool and queue counts, so every
        number beside the map agrees with it; the token counters and uptime_s let a reader derive current rates."""
        e = self.engine
        out = {**self.snapshot(), **block_map(e.kv, e.kv_cache_config.bytes_per_block)}
        total, cpu_total = out["num_blocks"], out["num_total_cpu_blocks"]
        out["num_total_gpu_blocks"] = total
        out["num_free_cpu_blocks"] = cpu_total - out["num_used_cpu_blocks"]
        out["gpu_cache_usage"] = out["num_used_gpu_blocks"] / total if total else 0.0
        out["cpu_cache_usage"] = out["num_used_cpu_blocks"] / cpu_total if cpu_total else 0.0
        return out
