"""vLLM's request fields and OpenAI's response shapes against a real engine (tiny random Qwen3-VL, started with
--return-tokens-as-token-ids): return_token_ids, return_tokens_as_token_ids (the flag and the field),
truncate_prompt_tokens, chat echo; a stream that opens with the role and empty content alone, a final chunk whose
delta carries content, system_fingerprint, prompt_logprobs null, prompt_tokens_details null without cached
tokens."""
from __future__ import annotations

import json

import pytest

from engine_server import http, start_engine_server

SERVED = "tiny-vl"
USER = [{"role": "user", "content": "Tell me about Paris."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-fields"), "--return-tokens-as-token-ids",
                              served_name=SERVED)
    yield srv
    srv.stop()


def post(server, path, body):
    reply = http("POST", server.url + path, body)
    assert reply.status == 200, reply.text
    return reply.json()


def stream(server, path, body) -> list[dict]:
    reply = http("POST", server.url + path, {**body, "stream": True})
    assert reply.status == 200, reply.text
    events = [e[len("data: "):] for e in reply.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- the shapes ------------------------------------------------------------------------------------------------
def test_a_chat_stream_opens_with_the_role_alone_and_ends_with_content(server):
    chunks = stream(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 5, **GREEDY})
    first = chunks[0]["choices"][0]
    assert first == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and "content" in last["delta"]
    whole = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 5, **GREEDY})
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == whole["choices"][0]["message"]["content"]
    fingerprints = {c["system_fingerprint"] for c in chunks} | {whole["system_fingerprint"]}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("localchat-")


def test_unasked_prompt_logprobs_are_null_and_no_cache_means_no_prompt_tokens_details(server):
    chat = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    assert chat["usage"]["prompt_tokens_details"] is None          # prefix caching is off: nothing to report
    completion = post(server, "/v1/completions", {"prompt": "Paris is", "max_tokens": 2})
    assert "prompt_logprobs" in completion["choices"][0] and completion["choices"][0]["prompt_logprobs"] is None
    assert completion["system_fingerprint"] == chat["system_fingerprint"]


# ---- return_token_ids ------------------------------------------------------------------------------------------
def test_chat_return_token_ids_streamed_and_not(server):
    body = {"messages": USER, "max_tokens": 6, "return_token_ids": True, **GREEDY}
    whole = post(server, "/v1/chat/completions", body)
    prompt_ids = post(server, "/tokenize", {"messages": USER})["tokens"]
    assert whole["prompt_token_ids"] == prompt_ids
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == 6
    assert post(server, "/detokenize", {"tokens": ids})["prompt"] == whole["choices"][0]["message"]["content"]
    chunks = stream(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == ids
    plain = post(server, "/v1/chat/completions", {**body, "return_token_ids": False})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completion_return_token_ids_streamed_and_not(server):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "return_token_ids": True, **GREEDY}
    choice = post(server, "/v1/completions", body)["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7, 8, 9] and len(choice["token_ids"]) == 4
    chunks = stream(server, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8, 9]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


# ---- return_tokens_as_token_ids --------------------------------------------------------------------------------
def test_logprobs_name_tokens_by_id_under_the_flag_unless_the_request_says_otherwise(server):
    body = {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            **GREEDY}
    choice = post(server, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(top["token"].startswith("token_id:") for e in content for top in e["top_logprobs"])
    as_text = post(server, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": False})["choices"][0]
    assert "".join(e["token"] for e in as_text["logprobs"]["content"]) == as_text["message"]["content"]
    completion = post(server, "/v1/completions", {"prompt": "Paris", "max_tokens": 3, "logprobs": 1,
                                                  "return_token_ids": True, **GREEDY})["choices"][0]
    assert completion["logprobs"]["tokens"] == [f"token_id:{t}" for t in completion["token_ids"]]


# ---- truncate_prompt_tokens ------------------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = list(range(20, 60))
    body = {"max_tokens": 5, "return_token_ids": True, **GREEDY}
    cut = post(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 10, **body})
    direct = post(server, "/v1/completions", {"prompt": ids[-10:], **body})
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["prompt_token_ids"] == ids[-10:]
    assert cut["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    chat = post(server, "/v1/chat/completions", {"messages": USER, "truncate_prompt_tokens": 4, **body})
    assert chat["prompt_token_ids"] == post(server, "/tokenize", {"messages": USER})["tokens"][-4:]
    kept = post(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 100, **body})
    assert kept["usage"]["prompt_tokens"] == 40


@pytest.mark.parametrize("value", [-2, 0, 2049, "5"])
def test_a_bad_truncate_prompt_tokens_is_a_400(server, value):
    for path, prompt in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER})):
        reply = http("POST", server.url + path, {**prompt, "max_tokens": 2, "truncate_prompt_tokens": value})
        assert reply.status == 400, reply.text
        assert reply.json()["error"]["param"] == "truncate_prompt_tokens"


# ---- chat echo -------------------------------------------------------------------------------------------------
def test_chat_echo_prepends_the_last_message_when_it_is_the_answers_role(server):
    messages = USER + [{"role": "assistant", "content": "Paris is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 4, **GREEDY}
    plain = post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "Paris is" + plain
    chunks = stream(server, "/v1/chat/completions", {**body, "echo": True})
    assert chunks[1]["choices"][0]["delta"] == {"content": "Paris is"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == echoed
    # The last message is the user's, the answer the assistant's: nothing to echo.
    after_user = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "echo": True, **GREEDY})
    assert after_user["choices"][0]["message"]["content"] == \
        post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **GREEDY})["choices"][0]["message"][
            "content"]
