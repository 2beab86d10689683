"""Sampling and stopping: the sampler draws from exactly the distribution the parameters describe, seeds make
a request reproducible whatever runs beside it, penalties match transformers, and every stop condition ends the
output where it should."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampler import SamplingMetadata, apply_penalties, sample
from engine_helpers import assert_pool_idle, make_llm
from oracle import hf_model

PROMPT = {"prompt_token_ids": list(range(40, 70))}


def metadata(rows: int, **kw) -> SamplingMetadata:
    base = dict(temperature=torch.ones(rows), greedy=torch.zeros(rows, dtype=torch.bool), all_greedy=False,
                top_k=None, top_p=None, min_p=None, presence=None, frequency=None, repetition=None,
                output_ids=[[]] * rows, prompt_ids=[[]] * rows, banned=[], generators={}, max_logprobs=None)
    base.update(kw)
    return SamplingMetadata(**base)


def draws(logits: torch.Tensor, rows: int = 20000, **kw) -> torch.Tensor:
    torch.manual_seed(0)
    return sample(logits.expand(rows, -1).clone(), metadata(rows, **kw)).token_ids


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_random_sampling_follows_the_softmax():
    counts = torch.bincount(draws(LOGITS), minlength=6).float() / 20000
    torch.testing.assert_close(counts, LOGITS.softmax(-1)[0], atol=0.012, rtol=0)


def test_temperature_sharpens_and_flattens():
    hot = torch.bincount(draws(LOGITS, temperature=torch.full((20000,), 2.0)), minlength=6).float() / 20000
    torch.testing.assert_close(hot, (LOGITS / 2).softmax(-1)[0], atol=0.012, rtol=0)


def test_top_k_keeps_only_the_k_most_likely():
    got = draws(LOGITS, top_k=torch.full((20000,), 2, dtype=torch.int64))
    assert set(got.tolist()) == {0, 1}
    assert abs((got == 0).float().mean().item() - LOGITS[0, :2].softmax(-1)[0].item()) < 0.012


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)[0]          # 0.55, 0.20, 0.12, 0.07, ...: p=0.7 needs tokens 0 and 1
    assert probs[0] < 0.7 <= probs[:2].sum()
    assert set(draws(LOGITS, top_p=torch.full((20000,), 0.7)).tolist()) == {0, 1}


def test_min_p_drops_tokens_below_a_share_of_the_best():
    probs = LOGITS.softmax(-1)[0]
    keep = {i for i, p in enumerate(probs.tolist()) if p >= 0.2 * probs.max().item()}
    assert set(draws(LOGITS, min_p=torch.full((20000,), 0.2)).tolist()) == keep


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, 5)
    out = apply_penalties(logits, metadata(1, presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]),
                                           output_ids=[[1, 1, 3]]))
    assert out[0].tolist() == [0.0, -1.0, 0.0, -0.75, 0.0]


def test_greedy_with_repetition_penalty_matches_transformers(qwen3_dir):
    llm = make_llm(qwen3_dir)
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12,
                                                ignore_eos=True))
    ids = torch.tensor([PROMPT["prompt_token_ids"]])
    ref = hf_model(str(qwen3_dir)).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                            min_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                                            eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_top_k_1_is_greedy(qwen3_dir):
    llm = make_llm(qwen3_dir)
    greedy, top1 = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                                   SamplingParams(temperature=1.0, top_k=1, max_tokens=10,
                                                                  ignore_eos=True)])
    assert greedy.outputs[0].token_ids == top1.outputs[0].token_ids


def test_a_seed_reproduces_its_output_alone_or_with_batch_mates(qwen3_dir):
    llm = make_llm(qwen3_dir)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    [alone] = llm.generate(PROMPT, seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    batched = llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7]}, PROMPT, {"prompt_token_ids": [9] * 20}],
                           [others[0], others[1], seeded, others[2]])
    assert batched[2].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_pool_idle(llm)


@pytest.fixture(scope="module")
def tiny(qwen3_dir):
    return make_llm(qwen3_dir)


def greedy_text(llm, **kw):
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return out.outputs[0]


def test_stop_string_ends_the_text_before_it(tiny):
    full = greedy_text(tiny)
    assert len(full.text) > 6
    stop = full.text[3:6]
    [out] = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    c = out.outputs[0]
    assert c.text == full.text[:full.text.index(stop)]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    [kept] = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                                  include_stop_str_in_output=True))
    assert kept.outputs[0].text == full.text[:full.text.index(stop) + len(stop)]
    assert_pool_idle(tiny)


def test_streamed_deltas_never_show_part_of_a_stop_string(tiny):
    full = greedy_text(tiny)
    stop = full.text[4:9]
    final = full.text[:full.text.index(stop)]
    engine = tiny.engine
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text_delta
            assert final.startswith(streamed), "streamed text past where the stop string cuts it"
    assert streamed == final


def test_stop_token_ids_and_max_tokens(tiny):
    full = greedy_text(tiny)
    token = full.token_ids[5]
    [out] = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop_token_ids=[token]))
    c = out.outputs[0]
    assert c.token_ids == full.token_ids[:full.token_ids.index(token) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", token)
    [short] = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3


def test_min_tokens_holds_back_stop_tokens(tiny):
    full = greedy_text(tiny)
    token = full.token_ids[1]
    [out] = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop_token_ids=[token], min_tokens=8))
    ids = out.outputs[0].token_ids
    assert len(ids) >= 8 and token not in ids[:7]


def test_min_tokens_holds_back_stop_strings(tiny):
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=10)
    [unstopped] = tiny.generate(PROMPT, SamplingParams(**params))
    full = unstopped.outputs[0]
    floor = len(tiny.engine.tokenizer.decode(full.token_ids[:10]))
    stop = full.text[2:4]                    # written within the first 10 tokens
    [out] = tiny.generate(PROMPT, SamplingParams(**params, stop=[stop]))
    c = out.outputs[0]
    assert len(c.token_ids) > 10
    later = full.text.find(stop, floor - len(stop) + 1)     # the first one that ends past the min_tokens text
    if later < 0:
        assert (c.text, c.finish_reason) == (full.text, "length")
    else:
        assert (c.text, c.finish_reason, c.stop_reason) == (full.text[:later], "stop", stop)
