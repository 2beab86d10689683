"""The Hugging Face transformers baseline on the same GPU, same shapes: Qwen3VLForConditionalGeneration with
random bf16 weights of the 8B config, plain generate() (sdpa, dynamic cache), greedy, fixed output lengths.

    python bench/hf_baseline.py --model DIR --out hf.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    from transformers import AutoConfig, GenerationConfig, Qwen3VLForConditionalGeneration

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="directory with the 8B config.json")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = AutoConfig.from_pretrained(args.model)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    vocab = 150000

    def gen(batch: int, prompt: int, new: int, **kw):
        ids = torch.randint(1000, vocab, (batch, prompt), device="cuda")
        cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        with torch.inference_mode():
            return timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg,
                                                **kw))

    gen(1, 32, 4)   # warm-up
    res = {"device": torch.cuda.get_device_name(), "transformers": __import__("transformers").__version__, "runs": []}
    res["ttft_512_ms"] = min(gen(1, 512, 1) for _ in range(3)) * 1e3
    res["ttft_8192_ms"] = min(gen(1, 8192, 1) for _ in range(2)) * 1e3
    for b in args.batches:
        torch.cuda.reset_peak_memory_stats()
        new = 128 if b == 1 else 256
        t1 = gen(b, 512, 1)
        tn = gen(b, 512, new)
        res["runs"].append({"batch": b, "prompt": 512, "new": new, "seconds": tn, "output_tok_s": b * new / tn,
                            "decode_ms_per_step": (tn - t1) / (new - 1) * 1e3,
                            "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
        print(json.dumps(res["runs"][-1]))
    # One 1024x1024 image (4096 patches -> 1024 tokens) + 20 text tokens, pixel values already on the GPU.
    grid = torch.tensor([[1, 64, 64]], device="cuda")
    pixels = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    ids = torch.cat([torch.tensor([[config.vision_start_token_id]]), torch.full((1, 1024), config.image_token_id),
                     torch.tensor([[config.vision_end_token_id]]), torch.randint(1000, vocab, (1, 20))], 1).cuda()
    mm = (ids == config.image_token_id).int()
    cfg = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)

    def image_step():
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grid,
                           mm_token_type_ids=mm, generation_config=cfg)
    image_step()
    res["image_ttft_ms"] = min(timed(image_step) for _ in range(3)) * 1e3
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
