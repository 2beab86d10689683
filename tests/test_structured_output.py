"""Structured output in the engine: whatever the (random) model prefers, a constrained request's output matches
its JSON schema, regex, choice or grammar, sampled hot, in a batch beside unconstrained requests and when the
KV pool is so small that requests are preempted; invalid constraints are refused before anything runs."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidInputError
from engine.logits_processors import _bits
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import apply_token_bitmask, bitmask_width
from engine_helpers import assert_pool_idle, make_llm

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return make_llm(qwen3_dir)


def hot(so: StructuredOutputsParams, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 200), structured_outputs=so,
                          **kw)


def test_bitmask_keeps_exactly_the_allowed_tokens():
    vocab = 70
    logits = torch.zeros(3, vocab)
    mask = torch.stack([_bits([0, 31, 32, 69], bitmask_width(vocab)), _bits([5], bitmask_width(vocab))])
    apply_token_bitmask(logits, mask, torch.tensor([0, 2]))
    assert (logits[0] == 0).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert (logits[1] == 0).all()                      # an unmasked row is untouched
    assert (logits[2] == 0).nonzero().flatten().tolist() == [5]


def test_json_schema_output_validates_at_temperature_one(llm):
    outs = llm.generate(["Tell me about a person."] * 3,
                        [hot(StructuredOutputsParams(json=SCHEMA), seed=s) for s in range(3)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert_pool_idle(llm)


def test_regex_choice_and_grammar(llm):
    params = [hot(StructuredOutputsParams(regex=r"[a-c]{2,5}-\d{3}"), 1),
              hot(StructuredOutputsParams(choice=["yes", "no", "maybe so"]), 2),
              hot(StructuredOutputsParams(grammar='start: "(" num (("+" | "*") num)* ")"\nnum: /[0-9]{1,3}/'), 3,
                  max_tokens=400),
              hot(StructuredOutputsParams(json_object=True, disable_any_whitespace=True), 4, max_tokens=600)]
    outs = [o.outputs[0] for o in llm.generate(["Go."] * 4, params)]
    assert all(c.finish_reason == "stop" for c in outs), [c.text for c in outs]
    assert re.fullmatch(r"[a-c]{2,5}-\d{3}", outs[0].text)
    assert outs[1].text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\(\d{1,3}([+*]\d{1,3})*\)", outs[2].text)
    assert isinstance(json.loads(outs[3].text), dict)


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Hello there"], free)[0].outputs[0].token_ids
    outs = llm.generate(["Hello there", "Pick one."], [free, hot(StructuredOutputsParams(choice=["red", "blue"]), 5)])
    assert outs[0].outputs[0].token_ids == alone      # the mask touches only its own row
    assert outs[1].outputs[0].text in ("red", "blue")


@pytest.mark.parametrize("swap_space", [0, 0.01], ids=["recompute", "swap"])
def test_output_validates_under_preemption(qwen3_dir, swap_space):
    small = make_llm(qwen3_dir, num_gpu_blocks_override=16, block_size=16, swap_space=swap_space, max_model_len=256)
    prompts = [f"The cat {i} sleeps." for i in range(5)]
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = small.generate(prompts, [hot(compact, seed=s, max_tokens=120)
                                    for s in range(5)])
    counters = small.engine.scheduler.counters
    assert (counters.num_swap_outs if swap_space else counters.num_recompute_preemptions) > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert_pool_idle(small)


@pytest.mark.parametrize("so, param", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_constraints_are_refused(llm, so, param):
    with pytest.raises(InvalidInputError) as err:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert err.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_constraint():
    with pytest.raises(InvalidInputError):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidInputError):
        StructuredOutputsParams()


def test_allowed_token_ids_logit_bias_and_bad_words(llm):
    tok = llm.get_tokenizer()
    allowed = tok.encode(" cat dog", add_special_tokens=False)
    out = llm.generate(["Hi"], SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True,
                                              allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    forced = allowed[0]
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                              logit_bias={forced: 100}))[0].outputs[0]
    assert out.token_ids == [forced] * 5
    greedy = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    word = re.findall(r"[A-Za-z]{2,}", greedy.text)[0]
    sequences = llm.engine.bad_words_token_ids([word])
    assert any(_contains(greedy.token_ids, seq) for seq in sequences)     # the greedy output has it...
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                              bad_words=[word]))[0].outputs[0]
    assert not any(_contains(out.token_ids, seq) for seq in sequences)    # ...and with bad_words it cannot


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))
