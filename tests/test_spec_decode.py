"""Speculative decoding keeps the target's output: greedy output with n-gram drafts is token for token the output
without them, in every engine mode (batched, chunked prefill, tiny pools that preempt by recompute or swap,
prefix caching) and with every sampling feature that reads earlier tokens (penalties, bad words, min_tokens,
stop strings, logprobs, a grammar); random output follows the target distribution; a verify step's rejected
drafts give their KV blocks back; and speculation stops where it would cost (large batches, drafts that miss)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import JUDGE_AFTER, MIN_BACKOFF_STEPS, PLAIN_EVERY, SpeculationPolicy
from engine.spec_decode.rejection_sampler import verify
from engine_helpers import assert_pool_idle, make_llm
from test_engine_equivalence import MODES, conversations

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# ---- the n-gram proposer ------------------------------------------------------------------------------------------
def test_ngram_drafts_what_followed_the_latest_longest_match():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]           # the 3-gram (1, 2, 3) seen before
    assert p.propose([7, 1, 8, 5, 1, 9, 6, 1]) == [9, 6, 1]               # of two matches, the latest
    assert p.propose([4, 5, 6, 4, 5, 7, 5, 6]) == [4, 5, 7]               # the 2-gram (5, 6) seen before
    assert p.propose([1, 2, 3]) == []                                     # nothing repeats
    assert p.propose([1, 2, 1, 2], max_tokens=1) == [1]                  # never past max_tokens


def test_ngram_respects_the_minimum_length():
    assert NgramProposer(4, 2, 3).propose([5, 1, 7, 1]) == []             # only a 1-gram repeats
    assert NgramProposer(4, 1, 3).propose([5, 1, 7, 1]) == [7, 1]


# ---- the configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, says", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of ngram, eagle3"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "unknown keys"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model is required for eagle3"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "/nonexistent"}, "not a draft-head directory"),
])
def test_a_wrong_speculative_config_is_refused_with_what_to_fix(bad, says):
    with pytest.raises(ValueError, match=says):
        SpeculativeConfig.parse(bad)


# ---- exactness -----------------------------------------------------------------------------------------------------
def run_all(llm, params_list) -> list[list[int]]:
    engine = llm.engine
    prompts = [engine.input_processor.process_chat(c) for c in conversations()]
    final = {}
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert_pool_idle(llm)
    return [final[f"r{i}"] for i in range(len(prompts))]


def accepted(llm) -> int:
    return llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"]


@pytest.fixture(scope="module")
def expected(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir)
    return [o.token_ids for o in run_all(llm, [GREEDY] * 5)]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_output_with_ngram_drafts_is_the_output_without(qwen3_vl_dir, expected, mode):
    llm = make_llm(qwen3_vl_dir, speculative_config=NGRAM, **MODES[mode])
    assert [o.token_ids for o in run_all(llm, [GREEDY] * 5)] == expected
    assert accepted(llm) > 0, "no draft was accepted: the test would not notice a wrong verify step"


SAMPLING_FEATURES = {
    "penalties": dict(repetition_penalty=1.02, presence_penalty=0.02, frequency_penalty=0.01),
    "logprobs": dict(logprobs=3),
    "min_tokens with eos": dict(min_tokens=12, ignore_eos=False),
    "stop strings": dict(stop=["e", " the"]),
    "bad words": dict(bad_words=["the", "ing"]),
    "logit bias": dict(logit_bias={5: 2.0, 17: -3.0}),
}


@pytest.mark.parametrize("feature", list(SAMPLING_FEATURES))
def test_sampling_features_see_the_drafts_as_sampled_tokens(qwen3_vl_dir, feature):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True,
                               **SAMPLING_FEATURES[feature]})
    plain = run_all(make_llm(qwen3_vl_dir), [params] * 5)
    spec_llm = make_llm(qwen3_vl_dir, speculative_config=NGRAM)
    spec = run_all(spec_llm, [params] * 5)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    if params.logprobs is not None:
        for a, b in zip(spec, plain):
            assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
            for ea, eb in zip(a.logprobs, b.logprobs):
                assert all(abs(ea[t] - eb[t]) < 1e-4 for t in eb)
    assert accepted(spec_llm) > 0


def test_prompt_logprobs_with_drafts(qwen3_vl_dir):
    # The prompt's logprobs are scored by the prefill, before any draft: the same as without drafts, and so are
    # the answers.
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    plain_llm, spec_llm = make_llm(qwen3_vl_dir), make_llm(qwen3_vl_dir, speculative_config=NGRAM)
    prompts = [plain_llm.engine.input_processor.process_chat(c) for c in conversations()]
    plain, spec = plain_llm.generate(prompts, params), spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(spec, plain):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ea.keys() == eb.keys() and all(abs(ea[t] - eb[t]) < 1e-4 for t in eb)
    assert accepted(spec_llm) > 0
    assert_pool_idle(spec_llm)


def test_a_grammar_checks_the_drafts(qwen3_dir):
    so = StructuredOutputsParams(regex=r"(ab|abc|b){3,12}c")
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
    prompt = [{"role": "user", "content": "abababab abcabc"}]
    [plain] = make_llm(qwen3_dir).chat(prompt, params)
    spec_llm = make_llm(qwen3_dir, speculative_config=NGRAM)
    [spec] = spec_llm.chat(prompt, params)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.outputs[0].text == plain.outputs[0].text
    assert accepted(spec_llm) > 0


# ---- the distribution of random output -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Row:
    """The runner's record of a request (CachedRequestState), as verify() reads it."""
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    eos_token_ids: set = dataclasses.field(default_factory=set)
    output_token_ids: list = dataclasses.field(default_factory=list)
    prompt_token_ids: list = dataclasses.field(default_factory=lambda: [0])
    bad_words_token_ids: list = dataclasses.field(default_factory=list)
    grammar: object = None
    allowed_token_bits: object = None


def row(temperature: float) -> _Row:
    return _Row(SamplingParams(temperature=temperature, max_tokens=8))


@dataclasses.dataclass
class _Sched:
    spec_token_ids: list
    num_output_tokens: int = 0


@pytest.mark.parametrize("draft", [[2, 0], [3, 3], [1, 2]])
def test_rejection_sampling_follows_the_target_distribution(draft):
    """Whatever is drafted, the first token is distributed as the target's p0 and, after it, the second as p1."""
    torch.manual_seed(0)
    n, vocab = 20000, 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]])
    logits = p.log().repeat(n, 1)                  # n requests, each with rows p0, p1, p2
    rows = [row(1.0) for _ in range(n)]
    out = verify(logits, rows, [_Sched(draft) for _ in range(n)], torch.device("cpu"))
    first = torch.tensor([t[0] for t in out.token_ids])
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert (freq - p[0]).abs().max() < 0.015, freq
    # The second token, among requests whose first token was the draft's (so row p1 applies).
    second = torch.tensor([t[1] for t in out.token_ids if t[0] == draft[0] and len(t) > 1])
    freq2 = torch.bincount(second, minlength=vocab).float() / len(second)
    assert (freq2 - p[1]).abs().max() < 0.03, freq2
    assert max(len(t) for t in out.token_ids) == 3 and min(len(t) for t in out.token_ids) == 1


def test_greedy_rows_accept_exactly_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    rows = [row(0.0)]
    out = verify(logits.clone(), rows, [_Sched([1, 0])], torch.device("cpu"))
    assert out.token_ids == [[1, 0, 2]]                           # both accepted, then the bonus token
    out = verify(logits.clone(), rows, [_Sched([1, 2])], torch.device("cpu"))
    assert out.token_ids == [[1, 0]]                              # the second rejected: row 1's argmax instead


# ---- the KV pool and when speculation runs ------------------------------------------------------------------------
def test_rejected_drafts_are_forgotten_and_hold_no_more_than_the_next_draft(qwen3_vl_dir):
    k = 8
    llm = make_llm(qwen3_vl_dir, block_size=1, num_gpu_blocks_override=4096,
                   speculative_config={**NGRAM, "num_speculative_tokens": k})
    engine = llm.engine
    engine.add_request("a", engine.input_processor.process_chat(conversations()[0]), GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.scheduler.requests.get("a")
        if req is not None and engine._inflight is None:
            # Only the KV of kept tokens counts as computed; with one block per token, the request holds at most
            # the slots of its newest token and of one more draft.
            assert req.num_computed_tokens == req.num_tokens - 1
            assert len(engine.kv.block_ids("a")) <= req.num_tokens + k
    counts = engine.get_stats()["spec_decode"]
    assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0     # some kept, some rejected
    assert_pool_idle(llm)


def test_large_batches_do_not_speculate(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    engine = llm.engine
    prompts = [engine.input_processor.process_chat(c) for c in conversations()]
    for i, prompt in enumerate(prompts):         # they finish one after the other: the batch shrinks
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10 + 10 * i, ignore_eos=True))
    drafted_with = []
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        engine.step()
        if engine._inflight is not None and any(s.spec_token_ids for s in engine._inflight.so.scheduled):
            drafted_with.append(running)
    assert drafted_with and max(drafted_with) < 3


def policy_with_costs(plain_ms=None, verify_ms=None, num_seqs=1, waiting_is_free=False) -> SpeculationPolicy:
    """A policy that has timed three plain and three verify steps of `num_seqs` sequences (those given)."""
    policy = SpeculationPolicy(SpeculativeConfig.parse(NGRAM), waiting_is_free=waiting_is_free)
    for _ in range(3):
        if plain_ms is not None:
            policy.costs.observe(num_seqs, speculative=False, seconds=plain_ms / 1000)
        if verify_ms is not None:
            policy.costs.observe(num_seqs, speculative=True, seconds=verify_ms / 1000)
    return policy


def speculate(policy, request_id, accepted_per_step, num_seqs=1):
    """Steps in which `request_id` drafts 4 tokens and keeps the next count of `accepted_per_step`, for as long as
    the policy lets it; returns how many steps it speculated."""
    steps = 0
    for accepted in accepted_per_step:
        policy.on_schedule(num_seqs)
        if not policy.allows(request_id):
            break
        policy.record(request_id, num_drafted=4, num_accepted=accepted, num_seqs=num_seqs)
        steps += 1
    return steps


def test_a_request_speculates_while_its_tokens_per_verify_step_beat_the_verify_steps_cost():
    # A verify step costs 1.4 plain steps: 2 tokens a step pay, 1.33 (one draft kept every third step) do not.
    policy = policy_with_costs(plain_ms=10, verify_ms=14)
    assert policy.costs.ratio(1) == pytest.approx(1.4)
    assert policy.on_schedule(1) and not policy.on_schedule(8)     # disable_by_batch_size 8 by default
    assert speculate(policy, "pays", [1] * 50) == 50
    assert speculate(policy, "costs", [1, 0, 0] * 50) < 20
    assert not policy.allows("costs")
    # Where verify steps cost hardly more than plain ones, the same drafts pay.
    cheap = policy_with_costs(plain_ms=10, verify_ms=11)
    assert speculate(cheap, "costs", [1, 0, 0] * 50) == 150


def test_a_request_backed_off_tries_again_later_and_waits_longer_each_time_in_a_row():
    policy = policy_with_costs(plain_ms=10, verify_ms=14)
    waits = []
    for _ in range(3):
        assert speculate(policy, "a", [0] * 50) == JUDGE_AFTER      # judged afresh after each back-off
        wait = 1                                     # the step that speculate() was refused in
        while not policy.allows("a"):
            policy.on_schedule(1)
            wait += 1
        waits.append(wait)
    assert waits == [MIN_BACKOFF_STEPS, 2 * MIN_BACKOFF_STEPS, 4 * MIN_BACKOFF_STEPS]
    assert speculate(policy, "a", [3] * 50) == 50


def test_before_the_costs_are_measured_only_drafts_that_keep_nothing_back_off():
    policy = policy_with_costs()
    assert policy.costs.ratio(1) is None
    assert speculate(policy, "some", [1, 0, 0] * 20) == 60
    assert speculate(policy, "none", [0] * 20) == JUDGE_AFTER


def test_a_batch_size_whose_plain_step_is_not_timed_gets_a_plain_step_now_and_then():
    policy = policy_with_costs(verify_ms=14)
    assert not policy.on_schedule(1)                    # nobody drafts: this step times the plain cost
    assert policy.on_schedule(2)                        # another size: nothing to time yet
    for _ in range(3):
        policy.costs.observe(1, speculative=False, seconds=0.01)
    assert policy.on_schedule(1)
    for _ in range(PLAIN_EVERY):
        policy.costs.observe(1, speculative=True, seconds=0.014)
    assert not policy.on_schedule(1)                    # timed again, so that the ratio follows the context


@pytest.mark.parametrize("waiting_is_free", [False, True], ids=["gpu", "cpu"])
def test_steps_with_nothing_to_draft_cost_speculation_only_where_waiting_costs(waiting_is_free):
    policy = policy_with_costs(plain_ms=10, verify_ms=14, waiting_is_free=waiting_is_free)
    policy.on_schedule(1)
    for _ in range(JUDGE_AFTER):
        policy.record("a", num_drafted=0, num_accepted=0, num_seqs=1)
    assert policy.allows("a") == waiting_is_free
    assert policy.is_speculative(drafted=False, speculating=True) != waiting_is_free


def test_the_engine_times_its_steps_with_and_without_drafts(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, speculative_config=NGRAM)
    llm.generate([llm.engine.input_processor.process_chat(conversations()[0])],
                 SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    ratio = llm.engine.scheduler.spec_policy.costs.ratio(1)
    assert ratio is not None and 0.2 < ratio < 20
    assert llm.engine.stats.snapshot()["spec_decode"]["verify_cost_ratio"]["1"] == round(ratio, 3)   # /stats


# ---- EAGLE-3 drafts through the engine ----------------------------------------------------------------------------
TEXT_CONVERSATIONS = [c for c in conversations() if isinstance(c[-1]["content"], str)]


def run_text(llm, params) -> list[list[int]]:
    outs = llm.chat(TEXT_CONVERSATIONS, params)
    assert_pool_idle(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def text_expected(qwen3_dir):
    return run_text(make_llm(qwen3_dir), GREEDY)


def eagle3(eagle3_dir, k: int = 3) -> dict:
    return {"method": "eagle3", "num_speculative_tokens": k, "model": str(eagle3_dir)}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_output_with_eagle3_drafts_is_the_output_without(qwen3_dir, eagle3_dir, text_expected, mode):
    llm = make_llm(qwen3_dir, speculative_config=eagle3(eagle3_dir), **MODES[mode])
    assert run_text(llm, GREEDY) == text_expected
    assert llm.engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0


def test_eagle3_drafts_reach_the_verify_step_and_accepted_ones_are_kept(qwen3_dir, eagle3_dir, text_expected,
                                                                         monkeypatch):
    """The drafter runs on every step's kept positions; here its drafts are replaced by the true continuation
    (known from a run without drafts), so a verify step that lost or misplaced them would show."""
    from engine.spec_decode.eagle3_proposer import Eagle3Proposer
    llm = make_llm(qwen3_dir, speculative_config=eagle3(eagle3_dir, k=4), max_num_seqs=1)
    prompts = [llm.engine.input_processor.process_chat(c).prompt_token_ids for c in TEXT_CONVERSATIONS]
    sequences = [p + out for p, out in zip(prompts, text_expected)]
    original = Eagle3Proposer.propose

    def oracle(self, feeds, aux_hidden):
        drafts = original(self, feeds, aux_hidden)
        for f in feeds:
            if f.request_id in drafts:
                last = f.positions[-1]          # the feed's last position; its next token is the newest one
                [seq] = [s for s in sequences if len(s) > last + 1 and s[last + 1] == f.next_token_ids[-1]]
                drafts[f.request_id] = seq[last + 2:last + 6] or [0]
        return drafts

    monkeypatch.setattr(Eagle3Proposer, "propose", oracle)
    assert run_text(llm, GREEDY) == text_expected
    stats = llm.engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 0.8 * stats["num_draft_tokens"] > 0
