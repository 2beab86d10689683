"""GET /metrics: Prometheus text (format 0.0.4) with vLLM's metric names, so vLLM dashboards work unchanged.

Gauges and token counters come from the engine's stats snapshot (the same numbers as /stats); per-request
latencies and finish reasons are recorded here by the server as requests finish.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets for these two histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
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
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out += [f"{name}_sum{{{labels}}} {self.total!r}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class ServerMetrics:
    """What only the server sees: when each finished request arrived, got its first token, and ended."""

    def __init__(self) -> None:
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.e2e_request_latency = Histogram(E2E_BUCKETS)
        self.request_success: Counter[str] = Counter()       # finished_reason -> count

    def on_finished(self, output: RequestOutput, now: float) -> None:
        m = output.metrics
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
        self.e2e_request_latency.observe(max(0.0, now - m.arrival_time))
        self.request_success[output.outputs[0].finish_reason or "abort"] += 1


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# (name, type, help, /stats key); vLLM's names (counters get `_total`, as prometheus_client writes them).
_FROM_STATS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:num_requests_swapped", "gauge", "Number of requests swapped to CPU.", "num_swapped"),
    ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.", "gpu_cache_usage"),
    ("vllm:cpu_cache_usage_perc", "gauge", "CPU KV-cache (swap) usage. 1 means 100 percent usage.",
     "cpu_cache_usage"),
    ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions from the engine.",
     "num_preemptions"),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "num_prompt_tokens"),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", "num_generation_tokens"),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
)


def render_metrics(stats: dict, server: ServerMetrics, model_name: str) -> str:
    labels = f'model_name="{_label_value(model_name)}"'
    lines: list[str] = []
    for name, kind, help_text, key in _FROM_STATS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {stats[key]!r}"]
    lines += ["# HELP vllm:cache_config_info Information of the KV cache configuration.",
              "# TYPE vllm:cache_config_info gauge",
              f'vllm:cache_config_info{{block_size="{stats["block_size"]}",'
              f'num_gpu_blocks="{stats["num_total_gpu_blocks"]}",num_cpu_blocks="{stats["num_total_cpu_blocks"]}",'
              f'enable_prefix_caching="{str(stats["prefix_caching"]).lower()}"}} 1.0']
    lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
              "# TYPE vllm:request_success_total counter"]
    for reason in ("stop", "length", "abort"):
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} '
                     f'{server.request_success.get(reason, 0)}')
    for name, hist, help_text in (
            ("vllm:time_to_first_token_seconds", server.time_to_first_token, "Histogram of time to first token "
             "in seconds."),
            ("vllm:e2e_request_latency_seconds", server.e2e_request_latency, "Histogram of end to end request "
             "latency in seconds.")):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *hist.lines(name, labels)]
    return "\n".join(lines) + "\n"
