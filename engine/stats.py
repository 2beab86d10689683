"""Engine counters for /stats, /metrics and the periodic vLLM-style throughput line in the log."""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, replace

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


@dataclass
class SpecDecodingStats:
    """vLLM's speculative-decoding counters. A draft is one request's proposed tokens verified in one step; the
    accepted ones are a prefix of it, so position i counts a draft whose first i + 1 tokens were accepted."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens or num_draft_tokens < 1:
            raise ValueError(f"a draft of {num_draft_tokens} tokens cannot have {num_accepted_tokens} accepted")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verify step yields per draft: the accepted ones plus the one the target model samples
        after them (vLLM's convention); 0 before any draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added after `earlier` (a copy of these counters taken before)."""
        old = earlier.num_accepted_tokens_per_pos
        per_pos = [n - (old[i] if i < len(old) else 0) for i, n in enumerate(self.num_accepted_tokens_per_pos)]
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)


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
        self.spec_decoding = SpecDecodingStats()
        self._spec_decoding_logged = SpecDecodingStats()    # the counters at the last log line

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
        """One request's draft verified in one step: num_draft_tokens proposed, its first num_accepted_tokens
        accepted."""
        self.spec_decoding.observe_draft(num_draft_tokens, num_accepted_tokens)

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
        self._log_spec_decoding(dt)
        self._last_log, self._interval_prompt, self._interval_gen = now, 0, 0

    def _log_spec_decoding(self, dt: float) -> None:
        """vLLM's "SpecDecoding metrics" line, over the drafts of the interval; none while nothing was drafted."""
        interval = self.spec_decoding.since(self._spec_decoding_logged)
        self._spec_decoding_logged = self.spec_decoding.copy()
        if self.speculative_config is None or interval.num_drafts == 0:
            return
        rates = ", ".join(f"{n / interval.num_drafts:.3f}" for n in interval.num_accepted_tokens_per_pos)
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, Drafted "
            "throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: %s, "
            "Avg Draft acceptance rate: %.1f%%", interval.mean_acceptance_length, interval.num_accepted_tokens / dt,
            interval.num_draft_tokens / dt, interval.num_accepted_tokens, interval.num_draft_tokens, rates,
            interval.acceptance_rate * 100)

    @property
    def speculative_config(self):
        """The engine's speculative decoding config (`--speculative-config`), None when it has none."""
        return getattr(self.engine.args, "speculative_config", None)

    def spec_decode_snapshot(self) -> dict | None:
        """/stats' `spec_decode`: the config's method and draft length with the counters; None with speculation
        off. The per-position counts cover every position the config drafts, as vLLM's counters do."""
        config = self.speculative_config
        if config is None:
            return None
        s = self.spec_decoding
        method, k = getattr(config, "method", None), getattr(config, "num_speculative_tokens", None)
        per_pos = s.num_accepted_tokens_per_pos
        per_pos = per_pos + [0] * ((k if isinstance(k, int) else 0) - len(per_pos))     # a copy, padded
        return {"method": None if method is None else str(method), "num_speculative_tokens": k,
                "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "num_accepted_tokens_per_pos": per_pos,
                "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length}

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
            "spec_decode": self._with_cost_ratios(self.spec_decode_snapshot(), sched.spec_policy),
        }

    @staticmethod
    def _with_cost_ratios(spec: dict | None, policy) -> dict | None:
        """spec_decode with the verify/plain step-cost ratio the policy measured per batch size: drafts pay while
        mean_acceptance_length exceeds it."""
        if spec is not None:
            spec["verify_cost_ratio"] = {} if policy is None else {str(n): round(r, 3)
                                                                   for n, r in policy.costs.ratios().items()}
        return spec

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
