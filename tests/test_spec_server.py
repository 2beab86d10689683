"""`--speculative-config` on the server: streamed answers with n-gram drafts are the answers without them (a
verify step's several tokens arrive as one delta, their logprobs one per token), and /stats and /metrics count
the drafts. A wrong config stops the engine at start with the line that says what to fix."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from engine_server import start_engine_server, stats

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
USER = [{"role": "user", "content": "Hello! How can I help you today? Hello! How can I help you today?"}]


@pytest.fixture(scope="module")
def servers(qwen3_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec-server")
    plain = start_engine_server(qwen3_dir, logs, served_name="m")
    spec = start_engine_server(qwen3_dir, logs, "--speculative-config", NGRAM, served_name="m")
    yield plain, spec
    plain.stop()
    spec.stop()


def stream(server) -> tuple[str, list[str], list[int]]:
    """(text, the logprobs' tokens, how many tokens each chunk carried)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    text, lp_tokens, sizes = "", [], []
    for chunk in client.chat.completions.create(model="m", messages=USER, max_tokens=40, temperature=0.0,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"ignore_eos": True}):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        text += choice.delta.content or ""
        if choice.logprobs and choice.logprobs.content:
            lp_tokens += [c.token for c in choice.logprobs.content]
            sizes.append(len(choice.logprobs.content))
    return text, lp_tokens, sizes


def test_streamed_answer_with_drafts_is_the_answer_without(servers):
    plain, spec = servers
    text, lp_tokens, _ = stream(plain)
    spec_text, spec_lp_tokens, sizes = stream(spec)
    assert spec_text == text and spec_lp_tokens == lp_tokens
    assert max(sizes) > 1                              # some verify step kept drafts: one delta, several tokens
    counts = stats(spec)["spec_decode"]
    assert counts["method"] == "ngram" and counts["num_accepted_tokens"] > 0
    assert stats(plain)["spec_decode"] is None


def test_several_choices_per_request_with_drafts_are_the_choices_without(servers):
    # n = 3: the server fans a request out into three engine requests, each drafting on its own; greedy, so the
    # three answers are the same three without drafts.
    def choices(server) -> list[str]:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="m", messages=USER, max_tokens=30, temperature=0.0, n=3,
                                             extra_body={"ignore_eos": True})
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    plain, spec = servers
    before = stats(spec)["spec_decode"]["num_accepted_tokens"]
    want, got = choices(plain), choices(spec)
    assert got == want and len(got) == 3
    assert stats(spec)["spec_decode"]["num_accepted_tokens"] > before


def test_metrics_count_drafted_and_accepted_tokens(servers):
    _, spec = servers
    stream(spec)
    import urllib.request
    body = urllib.request.urlopen(spec.url + "/metrics", timeout=10).read().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in body


def test_a_wrong_speculative_config_stops_the_engine_with_what_to_fix(qwen3_dir):
    proc = subprocess.run([sys.executable, "-m", "engine", "--model", str(qwen3_dir), "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 0}'], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "num_speculative_tokens must be a whole number >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
