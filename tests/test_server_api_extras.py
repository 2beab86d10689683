"""The rest of the OpenAI/vLLM request surface against a real engine (tiny random Qwen3-VL, prefix caching on):
n and best_of, prompt lists and echo, prompt logprobs (equal to transformers' on the same weights), the developer
role, continue_final_message, per-request chat templates, continuous usage, cached-token usage, /tokenize and
/detokenize."""
from __future__ import annotations

import json

import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine_server import http, start_engine_server, stats, wait_blocks_free
from oracle import hf_model

SERVED = "tiny-vl"
USER = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-extras"), "--enable-prefix-caching",
                              served_name=SERVED)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(qwen3_vl_dir):
    return AutoTokenizer.from_pretrained(qwen3_vl_dir)


def post(server, path, body):
    reply = http("POST", server.url + path, body)
    assert reply.status == 200, reply.text
    return reply.json()


def test_n_gives_n_choices_sharing_the_prompts_blocks(client, server):
    before = stats(server)["prefix_cache_hits"]
    long_prompt = [{"role": "user", "content": "Once upon a time there was a small cat. " * 4}]
    reply = client.chat.completions.create(model=SERVED, messages=long_prompt, n=3, temperature=1.0, seed=4,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1          # seed, seed + 1, seed + 2
    n_prompt = post(server, "/tokenize", {"messages": long_prompt})["count"]
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == n_prompt   # the prompt once
    # Choices 1 and 2 started once choice 0 had computed the prompt: its full blocks (the last token's excepted)
    # came from the cache.
    shared = 2 * ((n_prompt - 1) // 16) * 16
    assert reply.usage.prompt_tokens_details.cached_tokens == shared
    assert stats(server)["prefix_cache_hits"] - before == shared
    again = client.chat.completions.create(model=SERVED, messages=long_prompt, n=3, temperature=1.0, seed=4,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_n_streams_every_choice(client):
    texts, finished = {}, set()
    for chunk in client.chat.completions.create(model=SERVED, messages=USER, n=2, stream=True, max_tokens=5,
                                                temperature=1.0, seed=1, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and set(texts) == {0, 1}


@pytest.mark.parametrize("stream", [True, False])
def test_leaving_an_n_request_frees_every_choices_blocks(client, server, stream):
    slow = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1.5)
    kwargs = dict(model=SERVED, messages=USER, n=3, max_tokens=1500, extra_body={"ignore_eos": True})
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        next(iter(chunks))
        chunks.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            slow.chat.completions.create(**kwargs)
    wait_blocks_free(server, timeout=10)


def test_best_of_returns_the_most_likely_candidate(server):
    body = {"prompt": "The cat", "max_tokens": 6, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    all3 = post(server, "/v1/completions", {**body, "n": 3, "logprobs": 0})["choices"]
    best = max(all3, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    one = post(server, "/v1/completions", {**body, "best_of": 3})["choices"]
    assert len(one) == 1 and one[0]["text"] == best["text"] and one[0]["logprobs"] is None
    reply = http("POST", server.url + "/v1/completions", {**body, "best_of": 3, "stream": True})
    assert reply.status == 400 and reply.json()["error"]["param"] == "best_of"


def test_a_list_of_prompts_gives_n_choices_each_in_order(server, tok):
    reply = post(server, "/v1/completions", {"prompt": ["The cat", [40, 41, 42]], "n": 2, "max_tokens": 3,
                                             "temperature": 0, "ignore_eos": True})
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert reply["choices"][0]["text"] == reply["choices"][1]["text"]      # greedy: the same twice
    assert reply["usage"]["prompt_tokens"] == len(tok("The cat").input_ids) + 3
    assert reply["usage"]["completion_tokens"] == 12


def test_echo_and_prompt_logprobs_equal_transformers(server, qwen3_vl_dir, tok):
    prompt = "Once upon a time there was"
    reply = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2,
                                             "temperature": 0, "ignore_eos": True})
    choice = reply["choices"][0]
    assert choice["text"].startswith(prompt)
    ids = tok(prompt).input_ids
    lp = choice["logprobs"]["token_logprobs"]
    assert lp[0] is None and len(lp) == len(ids) + 2
    model = hf_model(qwen3_vl_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = [logits[i - 1, ids[i]].item() for i in range(1, len(ids))]
    torch.testing.assert_close(torch.tensor(lp[1:len(ids)]), torch.tensor(expected), atol=2e-3, rtol=0)
    chat = post(server, "/v1/chat/completions", {"messages": USER, "prompt_logprobs": 2, "max_tokens": 1})
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and all(len(e) >= 2 for e in entries[1:])


def test_completions_logprobs_zero_gives_the_chosen_token(server):
    lp = post(server, "/v1/completions", {"prompt": "The cat", "logprobs": 0, "max_tokens": 3,
                                          "temperature": 0})["choices"][0]["logprobs"]
    assert all(isinstance(t, dict) and len(t) == 1 for t in lp["top_logprobs"])
    assert [list(t.values())[0] for t in lp["top_logprobs"]] == lp["token_logprobs"]


def test_continuous_usage_and_cached_tokens(client):
    messages = [{"role": "user", "content": "A long shared prefix about cats and dogs. " * 4}]
    usages = [c.usage for c in client.chat.completions.create(
        model=SERVED, messages=messages, stream=True, max_tokens=4, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert all(u is not None for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == 4
    again = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_developer_role_is_the_system_turn(server):
    def prompt_tokens(role):
        return post(server, "/v1/chat/completions", {"messages": [{"role": role, "content": "Be brief."}] + USER,
                                                     "max_tokens": 1})["usage"]["prompt_tokens"]
    assert prompt_tokens("developer") == prompt_tokens("system")


def test_continue_final_message_and_a_request_template(server, tok):
    messages = USER + [{"role": "assistant", "content": "Once upon a"}]
    tokens = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                        "continue_final_message": True})["tokens"]
    expected = tok.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert tokens == tok(expected, add_special_tokens=False).input_ids
    reply = post(server, "/v1/chat/completions", {"messages": messages, "add_generation_prompt": False,
                                                  "continue_final_message": True, "max_tokens": 2})
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    tokens = post(server, "/tokenize", {"messages": USER, "chat_template": template})["tokens"]
    assert tok.decode(tokens) == "[user] Tell me a story about a cat.\n"
    escape = http("POST", server.url + "/v1/chat/completions",
                  {"messages": USER, "chat_template": "{{ ''.__class__.__mro__ }}", "max_tokens": 1})
    assert escape.status == 400, escape.text


def test_tokenize_and_detokenize(server, tok):
    reply = post(server, "/tokenize", {"prompt": "Hello cat", "add_special_tokens": False})
    assert reply["tokens"] == tok("Hello cat", add_special_tokens=False).input_ids
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == 2048
    assert post(server, "/detokenize", {"tokens": reply["tokens"]})["prompt"] == "Hello cat"
    bad = http("POST", server.url + "/detokenize", {"tokens": [10 ** 9]})
    assert bad.status == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA"}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": 500}}, "logit_bias"),
    ({"messages": USER, "allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": 2, "best_of": 1}, "best_of"),
    ({"messages": USER + [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
])
def test_refused_inputs_name_the_field(server, body, param):
    reply = http("POST", server.url + "/v1/chat/completions", {"max_tokens": 2, **body})
    assert reply.status == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_logit_bias_over_http(server, tok):
    forced = tok(" cat", add_special_tokens=False).input_ids[-1]
    reply = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0,
                                                  "logit_bias": {str(forced): 100}, "ignore_eos": True})
    assert reply["choices"][0]["message"]["content"] == tok.decode([forced] * 3)


V1_NAMES = {  # vLLM V1's /metrics (vllm/v1/metrics/loggers.py), as prometheus_client's parser names families
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:gpu_prefix_cache_queries": "counter", "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    **{name: "histogram" for name in (
        "vllm:iteration_tokens_total", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
        "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
        "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds", "vllm:time_per_prefill_token_request_seconds")},
}


def read_metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    reply = http("GET", server.url + "/metrics")
    assert reply.status == 200
    return {f.name: f for f in text_string_to_metric_families(reply.text)}


def value(families, name, suffix="", **labels):
    return sum(s.value for s in families[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_carry_vllm_v1_names_with_real_values(server):
    before = read_metrics(server)
    assert {n: before[n].type for n in V1_NAMES if n in before} == V1_NAMES
    # Speculation off: /stats says so, and /metrics has no spec_decode counters.
    assert stats(server)["spec_decode"] is None
    assert not [name for name in before if name.startswith("vllm:spec_decode")]
    reply = post(server, "/v1/completions", {"prompt": "The cat sat", "max_tokens": 7, "temperature": 0,
                                             "ignore_eos": True, "n": 2})
    after = read_metrics(server)
    usage = reply["usage"]
    assert value(after, "vllm:request_params_n", "_sum") - value(before, "vllm:request_params_n", "_sum") == 2
    assert value(after, "vllm:request_generation_tokens", "_sum") - \
        value(before, "vllm:request_generation_tokens", "_sum") == usage["completion_tokens"] == 14
    assert value(after, "vllm:request_prompt_tokens", "_sum") - \
        value(before, "vllm:request_prompt_tokens", "_sum") == 2 * usage["prompt_tokens"]
    assert value(after, "vllm:request_success", "_total", finished_reason="length") - \
        value(before, "vllm:request_success", "_total", finished_reason="length") == 2
    # six gaps between seven tokens, per choice
    assert value(after, "vllm:inter_token_latency_seconds", "_count") - \
        value(before, "vllm:inter_token_latency_seconds", "_count") == 12
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:time_to_first_token_seconds"):
        assert value(after, name, "_count") - value(before, name, "_count") == 2
    steps = value(after, "vllm:iteration_tokens_total", "_count") - value(before, "vllm:iteration_tokens_total",
                                                                            "_count")
    tokens = value(after, "vllm:iteration_tokens_total", "_sum") - value(before, "vllm:iteration_tokens_total",
                                                                         "_sum")
    assert steps >= 7 and tokens >= usage["prompt_tokens"] + 12
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
