"""A Qwen3-VL-8B-Instruct model directory without real weights, for benchmarks with --load-format dummy.

Real weights cannot be downloaded here, and speed does not depend on their values. The directory holds the
reference config, preprocessor config, generation config and chat template, plus a synthetic tokenizer with
Qwen's vocabulary size whose special tokens sit at Qwen's ids (<|im_start|> 151644, <|image_pad|> 151655, ...),
so chat requests with images render and expand exactly as for the real model.

    python bench/synthetic_model.py /tmp/qwen3-vl-8b-synthetic
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "model_configs" / "qwen3-vl-8b-instruct"
FIRST_SPECIAL_ID = 151643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def build(out_dir: str | Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "preprocessor_config.json", "generation_config.json", "chat_template.jinja"):
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
    (out / "SYNTHETIC.json").write_text(json.dumps({"note": "random weights only (--load-format dummy)"}))
    return out


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen3-vl-8b-synthetic"))
