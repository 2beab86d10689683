"""A Qwen3-VL-8B-Instruct model directory without real weights, for benchmarks with --load-format dummy.

Real weights cannot be downloaded here, and speed does not depend on their values. The directory holds the
reference config, image and video preprocessor configs, generation config and chat template, plus a synthetic
tokenizer with Qwen's vocabulary size whose special tokens sit at Qwen's ids (<|im_start|> 151644, <|image_pad|> 151655, ...),
so chat requests with images render and expand exactly as for the real model.

    python bench/synthetic_model.py /tmp/qwen3-vl-8b-synthetic
    python bench/synthetic_model.py /tmp/qwen3-vl-8b-awq --quantization awq     # + a quantization_config

With --quantization (fp8, awq, gptq, compressed-tensors) config.json also carries the quantization_config the
published checkpoints of that format carry, so --load-format dummy makes random weights in that format.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "model_configs" / "qwen3-vl-8b-instruct"
FIRST_SPECIAL_ID = 151643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


# What the published Qwen3-VL-8B checkpoints of each format say (Qwen's FP8; AutoAWQ; GPTQ v1; llm-compressor W4A16).
QUANTIZATION_CONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.visual.merger", "model.visual.deepstack_merger_list"]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ["visual"]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq", "modules_to_not_convert": ["visual"]},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}},
        "ignore": ["lm_head", "re:.*visual.*"]},
}


def build(out_dir: str | Path, quantization: str | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json", "generation_config.json",
                 "chat_template.jinja"):
        shutil.copy(REFERENCE / name, out / name)
    # Byte-level alphabet first (every text encodes), then filler entries up to Qwen's first special id.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<filler_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.eos_token, fast.pad_token = "<|im_end|>", "<|endoftext|>"
    ids = fast.convert_tokens_to_ids(SPECIALS)
    assert ids == list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(SPECIALS))), ids
    fast.save_pretrained(out)
    if quantization is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = QUANTIZATION_CONFIGS[quantization]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "SYNTHETIC.json").write_text(json.dumps({"note": "random weights only (--load-format dummy)",
                                                    "quantization": quantization}))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default="/tmp/qwen3-vl-8b-synthetic")
    parser.add_argument("--quantization", "-q", choices=sorted(QUANTIZATION_CONFIGS), default=None)
    args = parser.parse_args()
    print(build(args.out_dir, args.quantization))
