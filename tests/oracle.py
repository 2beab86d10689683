"""transformers as the oracle: greedy generation with per-step logits on the same weights and inputs."""
from __future__ import annotations

import functools

import torch

from engine.inputs.types import ProcessedPrompt


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    cls = Qwen3VLForConditionalGeneration if config.model_type == "qwen3_vl" else AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir, prompt: ProcessedPrompt, max_new_tokens: int, image_token_id: int | None = None):
    """Greedy continuation of exactly these prompt tokens and pixel values, never stopping early.
    Returns (token ids, [log_softmax over the vocabulary per generated token])."""
    from transformers import GenerationConfig

    model = hf_model(str(model_dir))
    ids = torch.tensor([prompt.prompt_token_ids])
    kwargs = {"attention_mask": torch.ones_like(ids)}
    if prompt.images:
        from engine.inputs.image_processor import ImageProcessor
        to_pixels = ImageProcessor.from_model_dir(str(model_dir)).to_pixel_values
        kwargs["pixel_values"] = torch.cat([to_pixels(im.raw) for im in prompt.images])
        kwargs["image_grid_thw"] = torch.tensor([im.grid_thw for im in prompt.images])
        # Without mm_token_type_ids transformers silently falls back to 1-D positions.
        kwargs["mm_token_type_ids"] = (ids == image_token_id).int()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, generation_config=gen, output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [step[0].float().log_softmax(-1) for step in out.logits]
    return tokens, logprobs
