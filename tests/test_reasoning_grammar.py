"""A structured output that starts after the reasoning, in the offline engine: the tiny Thinking Qwen3-VL, whose
`</think>` is one added token that the grammar names by id. Each output is free reasoning, `</think>`, at most
four whitespace characters, then exactly one of the choices, for a batch of differently seeded requests; on the
CPU, and on a CUDA GPU (pytest -m gpu) eager and with CUDA graphs, where the mask is applied on the device."""
from __future__ import annotations

import re

import pytest
import torch

from engine import SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine_helpers import assert_pool_idle, make_llm

CONVERSATION = [{"role": "user", "content": "Is Paris the capital of France?"}]
ANSWER = re.compile(r"[ \t\n]{0,4}(yes|no)")


def check_answers_after_reasoning(llm) -> None:
    end = llm.engine.tokenizer.convert_tokens_to_ids("</think>")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=96, logit_bias={end: 6.0},
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"], reasoning_end="</think>"))
              for seed in range(6)]
    outs = llm.chat([CONVERSATION] * len(params), params)
    ended = 0
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason == "length":
            assert end not in c.token_ids            # cut while still reasoning: the constraint never began
            continue
        ended += 1
        assert c.token_ids.count(end) == 1
        reasoning, _, answer = c.text.partition("</think>")
        assert ANSWER.fullmatch(answer), repr(c.text)
    assert ended, "no request reached its answer; raise the logit bias"
    assert_pool_idle(llm)


def test_answers_after_reasoning_on_the_cpu(qwen3_vl_thinking_dir):
    check_answers_after_reasoning(make_llm(qwen3_vl_thinking_dir, device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_answers_after_reasoning_on_the_gpu(qwen3_vl_thinking_dir, eager):
    check_answers_after_reasoning(make_llm(qwen3_vl_thinking_dir, enforce_eager=eager))
