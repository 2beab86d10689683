"""--seed seeds the engine's random state as vLLM's does: the same requests in the same order sample the same
tokens after a restart; another seed samples others."""
from __future__ import annotations

from engine import SamplingParams
from engine_helpers import make_llm

PROMPTS = ["The weather today", "Once upon a time", "A list of fruits:"]


def sample(model_dir, seed: int) -> list[list[int]]:
    llm = make_llm(model_dir, seed=seed)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_the_same_seed_samples_the_same_tokens_across_restarts(qwen3_dir):
    first = sample(qwen3_dir, seed=1234)
    assert sample(qwen3_dir, seed=1234) == first
    assert sample(qwen3_dir, seed=4321) != first
