"""Speculative decoding's counters (engine/stats.py) as users see them: /stats' `spec_decode`, vLLM's
"SpecDecoding metrics" log line and its `vllm:spec_decode_*` counters on /metrics; none of it with speculation off."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import ServerMetrics, render_metrics
from engine.stats import SpecDecodingStats, StatLogger
from engine_helpers import make_llm

NGRAM4 = SimpleNamespace(method="ngram", num_speculative_tokens=4)


def logger_with(config) -> StatLogger:
    """A StatLogger of an engine whose only part read here is its args' speculative config."""
    return StatLogger(SimpleNamespace(args=SimpleNamespace(speculative_config=config)))


def three_drafts(stats) -> None:
    """Drafts of 3, 3 and 5 tokens with 2, 0 and 5 accepted."""
    for drafted, accepted in ((3, 2), (3, 0), (5, 5)):
        stats.on_spec_decode(drafted, accepted)


# ---- the counters -------------------------------------------------------------------------------------------------
def test_each_draft_adds_its_tokens_and_its_accepted_prefix_per_position():
    stats = logger_with(NGRAM4)
    three_drafts(stats)
    s = stats.spec_decoding
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 11, 7)
    # Position i counts the drafts whose first i + 1 tokens were accepted; the list grows with the longest draft.
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1, 1]
    assert s.acceptance_rate == pytest.approx(7 / 11)
    assert s.mean_acceptance_length == pytest.approx(1 + 7 / 3)


def test_no_drafts_read_as_zero_rates():
    s = SpecDecodingStats()
    assert (s.acceptance_rate, s.mean_acceptance_length) == (0.0, 0.0)


@pytest.mark.parametrize("drafted, accepted", [(0, 0), (2, 3), (2, -1)])
def test_an_impossible_draft_is_refused_with_its_numbers(drafted, accepted):
    stats = logger_with(NGRAM4)
    with pytest.raises(ValueError, match=f"a draft of {drafted} tokens cannot have {accepted} accepted"):
        stats.on_spec_decode(drafted, accepted)
    assert stats.spec_decoding == SpecDecodingStats()


def test_since_is_the_interval_between_two_copies():
    s = SpecDecodingStats()
    s.observe_draft(2, 1)
    before = s.copy()
    s.observe_draft(4, 3)
    s.observe_draft(1, 0)
    assert before.num_accepted_tokens_per_pos == [1, 0]          # the copy keeps its own list
    assert s.since(before) == SpecDecodingStats(2, 5, 3, [1, 1, 1, 0])


# ---- /stats' spec_decode ------------------------------------------------------------------------------------------
def test_spec_decode_is_none_without_a_speculative_config():
    assert logger_with(None).spec_decode_snapshot() is None
    assert StatLogger(SimpleNamespace(args=SimpleNamespace())).spec_decode_snapshot() is None   # args without the field


def test_spec_decode_names_the_method_and_covers_every_drafted_position():
    stats = logger_with(NGRAM4)
    assert stats.spec_decode_snapshot() == {
        "method": "ngram", "num_speculative_tokens": 4, "num_drafts": 0, "num_draft_tokens": 0,
        "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [0, 0, 0, 0], "acceptance_rate": 0.0,
        "mean_acceptance_length": 0.0}
    stats.on_spec_decode(3, 1)
    snap = stats.spec_decode_snapshot()
    assert snap["num_accepted_tokens_per_pos"] == [1, 0, 0, 0]
    assert (snap["acceptance_rate"], snap["mean_acceptance_length"]) == (pytest.approx(1 / 3), 2.0)
    stats.on_spec_decode(3, 3)                                   # a snapshot is a copy the engine no longer changes
    assert snap["num_accepted_tokens_per_pos"] == [1, 0, 0, 0] and snap["num_drafts"] == 1


def test_a_config_without_method_or_length_still_counts():
    stats = logger_with(SimpleNamespace())
    stats.on_spec_decode(2, 2)
    snap = stats.spec_decode_snapshot()
    assert snap["method"] is None and snap["num_speculative_tokens"] is None
    assert snap["num_accepted_tokens_per_pos"] == [1, 1] and snap["acceptance_rate"] == 1.0


# ---- /metrics ----------------------------------------------------------------------------------------------------
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def base_stats(**over) -> dict:
    """The /stats fields render_metrics reads, all zero."""
    stats = {key: 0 for key in ("num_running", "num_waiting", "num_swapped", "gpu_cache_usage", "cpu_cache_usage",
                                "num_preemptions", "num_prompt_tokens", "num_generation_tokens",
                                "prefix_cache_queries", "prefix_cache_hits", "num_total_gpu_blocks",
                                "num_total_cpu_blocks")}
    return {**stats, "block_size": 16, "prefix_caching": False, **over}


def families(stats: dict, model_name: str = "tiny-vl") -> dict:
    text = render_metrics(stats, ServerMetrics(), model_name, StatLogger(None).iteration_tokens)
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_carry_vllms_spec_decode_counters_labelled_like_the_others():
    stats = logger_with(NGRAM4)
    three_drafts(stats)
    found = families(base_stats(spec_decode=stats.spec_decode_snapshot()))
    for name, value in (("vllm:spec_decode_num_drafts", 3), ("vllm:spec_decode_num_draft_tokens", 11),
                        ("vllm:spec_decode_num_accepted_tokens", 7)):
        family = found[name]
        assert family.type == "counter"
        assert [(s.name, s.labels, s.value) for s in family.samples] == [(name + "_total", {"model_name": "tiny-vl"},
                                                                          value)]
    assert found["vllm:spec_decode_num_drafts"].documentation == "Number of spec decoding drafts."
    per_pos = found[PER_POS]
    assert per_pos.type == "counter" and per_pos.documentation == "Accepted tokens per draft position."
    assert [(s.name, s.labels, s.value) for s in per_pos.samples] == [
        (PER_POS + "_total", {"model_name": "tiny-vl", "position": str(i)}, n) for i, n in enumerate([2, 2, 1, 1, 1])]


def test_metrics_have_no_spec_decode_counters_with_speculation_off():
    found = families(base_stats(spec_decode=None))
    assert "vllm:num_preemptions" in found
    assert not [name for name in found if name.startswith("vllm:spec_decode")]


# ---- on a real engine ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(qwen3_vl_dir):
    return make_llm(qwen3_vl_dir, num_gpu_blocks_override=32, max_model_len=256)


def test_an_engine_without_speculation_reports_none(llm):
    assert llm.engine.stats.snapshot()["spec_decode"] is None


def test_an_engine_with_speculation_logs_vllms_line_and_reports_the_counters(llm, engine_log, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine.args, "speculative_config", SimpleNamespace(method="eagle3", num_speculative_tokens=3),
                        raising=False)
    stats = engine.stats
    monkeypatch.setattr(stats, "spec_decoding", SpecDecodingStats())
    monkeypatch.setattr(stats, "_spec_decoding_logged", SpecDecodingStats())
    stats.on_spec_decode(3, 3)
    stats.on_spec_decode(3, 1)
    stats._last_log -= 10                       # the log interval has passed
    stats.on_tokens(0)
    lines = [r.getMessage() for r in engine_log.records if r.getMessage().startswith("SpecDecoding metrics")]
    assert len(lines) == 1
    line = lines[0]
    assert "Mean acceptance length: 3.00" in line and "Accepted: 4 tokens, Drafted: 6 tokens" in line
    assert "Per-position acceptance rate: 1.000, 0.500, 0.500" in line and "Avg Draft acceptance rate: 66.7%" in line
    # The next interval had no drafts: no line.
    stats._last_log -= 10
    stats.on_tokens(0)
    assert len([r for r in engine_log.records if r.getMessage().startswith("SpecDecoding metrics")]) == 1
    spec = engine.stats.snapshot()["spec_decode"]
    assert spec["method"] == "eagle3" and spec["num_drafts"] == 2 and spec["num_accepted_tokens_per_pos"] == [2, 1, 1]
    assert families(engine.stats.snapshot())["vllm:spec_decode_num_accepted_tokens"].samples[0].value == 4


def test_the_log_stays_silent_about_speculation_when_it_is_off(llm, engine_log):
    stats = llm.engine.stats
    stats._last_log -= 10
    stats.on_tokens(0)
    assert any(r.getMessage().startswith("Avg prompt throughput") for r in engine_log.records)
    assert not any("SpecDecoding" in r.getMessage() for r in engine_log.records)
