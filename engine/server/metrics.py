"""GET /metrics: Prometheus text (format 0.0.4) with vLLM V1's metric names, types and buckets, so vLLM's
Grafana dashboard works unchanged; ours (swap) stay beside them.

Gauges and token counters come from the engine's stats snapshot (the same numbers as /stats), the histogram of
tokens per engine step from the engine's StatLogger; per-request counts and latencies are recorded here as
requests finish, from the timestamps the engine stamps on each request (arrival, first scheduled, each token).
"""
from __future__ import annotations

from collections import Counter

from engine.outputs import RequestOutput
from engine.stats import Histogram, build_1_2_5_buckets

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

# name -> help; the request histograms, in vLLM's words.
_TIMES = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("Histogram of time per output token in seconds.", TPOT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", E2E_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", E2E_BUCKETS),
    "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.", E2E_BUCKETS),
    "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS),
    "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.", E2E_BUCKETS),
    "vllm:time_per_prefill_token_request_seconds": ("Time spent per token during prefill phase in seconds.",
                                                    PREFILL_TOKEN_BUCKETS),
}
_COUNTS = {
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
}


class ServerMetrics:
    """What the server sees of each request: its parameters when it starts, its timings when it ends."""

    def __init__(self, max_model_len: int = 8192) -> None:
        self.times = {name: Histogram(buckets) for name, (_, buckets) in _TIMES.items()}
        count_buckets = tuple(build_1_2_5_buckets(max_model_len))
        self.counts = {name: Histogram(count_buckets) for name in _COUNTS}
        self.params_n = Histogram(N_BUCKETS)
        self.request_success: Counter[str] = Counter()       # finished_reason -> count

    def on_started(self, n: int, max_tokens: int | None) -> None:
        self.params_n.observe(n)
        if max_tokens is not None:
            self.counts["vllm:request_params_max_tokens"].observe(max_tokens)

    def on_finished(self, output: RequestOutput, now: float) -> None:
        m, c = output.metrics, output.outputs[0]
        t = self.times
        t["vllm:e2e_request_latency_seconds"].observe(max(0.0, now - m.arrival_time))
        if m.first_scheduled_time is not None:
            t["vllm:request_queue_time_seconds"].observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            end = m.last_token_time or now
            t["vllm:request_inference_time_seconds"].observe(max(0.0, end - m.first_scheduled_time))
        if m.first_token_time is not None:
            t["vllm:time_to_first_token_seconds"].observe(max(0.0, m.first_token_time - m.arrival_time))
            t["vllm:request_decode_time_seconds"].observe(max(0.0, (m.last_token_time or now) - m.first_token_time))
            if m.first_scheduled_time is not None:
                prefill = max(0.0, m.first_token_time - m.first_scheduled_time)
                t["vllm:request_prefill_time_seconds"].observe(prefill)
                if output.prompt_token_ids:
                    t["vllm:time_per_prefill_token_request_seconds"].observe(prefill / len(output.prompt_token_ids))
        for gap in m.inter_token_latencies:
            t["vllm:time_per_output_token_seconds"].observe(gap)
            t["vllm:inter_token_latency_seconds"].observe(gap)
        self.counts["vllm:request_prompt_tokens"].observe(len(output.prompt_token_ids))
        self.counts["vllm:request_generation_tokens"].observe(len(c.token_ids))
        self.counts["vllm:request_max_num_generation_tokens"].observe(len(c.token_ids))
        self.request_success[c.finish_reason or "abort"] += 1


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# (name, type, help, /stats key); counters get `_total`, as prometheus_client writes them.
_FROM_STATS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:num_requests_swapped", "gauge", "Number of requests swapped to CPU.", "num_swapped"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "gpu_cache_usage"),
    ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
     "vllm:kv_cache_usage_perc instead.", "gpu_cache_usage"),
    ("vllm:cpu_cache_usage_perc", "gauge", "CPU KV-cache (swap) usage. 1 means 100 percent usage.",
     "cpu_cache_usage"),
    ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
     "num_preemptions"),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "num_prompt_tokens"),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", "num_generation_tokens"),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    ("vllm:gpu_prefix_cache_queries_total", "counter", "GPU prefix cache queries, in terms of number of queried "
     "tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.", "prefix_cache_queries"),
    ("vllm:gpu_prefix_cache_hits_total", "counter", "GPU prefix cache hits, in terms of number of cached tokens. "
     "DEPRECATED: Use vllm:prefix_cache_hits instead.", "prefix_cache_hits"),
)


# (name, help, /stats spec_decode key): vLLM's speculative-decoding counters, present only with speculation on.
_SPEC_DECODE = (
    ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", "num_accepted_tokens"),
)
_SPEC_DECODE_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def _spec_decode_lines(spec: dict, labels: str) -> list[str]:
    lines: list[str] = []
    for name, help_text, key in _SPEC_DECODE:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name}{{{labels}}} {spec[key]}"]
    lines += [f"# HELP {_SPEC_DECODE_PER_POS} Accepted tokens per draft position.",
              f"# TYPE {_SPEC_DECODE_PER_POS} counter"]
    lines += [f'{_SPEC_DECODE_PER_POS}{{{labels},position="{i}"}} {n}'
              for i, n in enumerate(spec["num_accepted_tokens_per_pos"])]
    return lines


def render_metrics(stats: dict, server: ServerMetrics, model_name: str, iteration_tokens: Histogram) -> str:
    labels = f'model_name="{_label_value(model_name)}"'
    lines: list[str] = []
    for name, kind, help_text, key in _FROM_STATS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {stats[key]!r}"]
    lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
              "# TYPE vllm:cache_config_info gauge",
              f'vllm:cache_config_info{{block_size="{stats["block_size"]}",'
              f'num_gpu_blocks="{stats["num_total_gpu_blocks"]}",num_cpu_blocks="{stats["num_total_cpu_blocks"]}",'
              f'enable_prefix_caching="{str(stats["prefix_caching"]).lower()}"}} 1.0']
    lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
              "# TYPE vllm:request_success_total counter"]
    for reason in ("stop", "length", "abort"):
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} '
                     f'{server.request_success.get(reason, 0)}')
    histograms = [("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                   iteration_tokens),
                  ("vllm:request_params_n", "Histogram of the n request parameter.", server.params_n)]
    histograms += [(name, help_text, server.times[name]) for name, (help_text, _) in _TIMES.items()]
    histograms += [(name, help_text, server.counts[name]) for name, help_text in _COUNTS.items()]
    for name, help_text, hist in histograms:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *hist.lines(name, labels)]
    if stats.get("spec_decode") is not None:
        lines += _spec_decode_lines(stats["spec_decode"], labels)
    return "\n".join(lines) + "\n"
