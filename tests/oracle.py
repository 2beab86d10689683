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
def hf_greedy(model_dir, prompt: ProcessedPrompt, max_new_tokens: int, image_token_id: int | None = None,
              video_token_id: int | None = None):
    """Greedy continuation of exactly these prompt tokens and pixel values, never stopping early.
    Returns (token ids, [log_softmax over the vocabulary per generated token]). A video's frame groups are given
    to transformers as videos of one group each: its vision tower attends within each frame and get_rope_index
    splits a video into its frames, so that is the same computation as one video of all the groups."""
    ids = torch.tensor([prompt.prompt_token_ids])
    kwargs = {}
    if prompt.images:
        from engine.inputs.image_processor import ImageProcessor
        to_pixels = ImageProcessor.from_model_dir(str(model_dir)).to_pixel_values
        kinds = {"image": [], "video": []}
        for item in prompt.images:
            kinds["video" if prompt.prompt_token_ids[item.offset] == video_token_id else "image"].append(item)
        for kind, items in kinds.items():
            if items:
                prefix = "pixel_values" if kind == "image" else "pixel_values_videos"
                kwargs[prefix] = torch.cat([to_pixels(it.raw) for it in items])
                kwargs[f"{kind}_grid_thw"] = torch.tensor([it.grid_thw for it in items])
        # Without mm_token_type_ids transformers silently falls back to 1-D positions.
        kwargs["mm_token_type_ids"] = (ids == image_token_id).int() + 2 * (ids == (video_token_id or -1)).int()
    return hf_generate(model_dir, ids, max_new_tokens, **kwargs)


@torch.inference_mode()
def hf_generate(model_dir, ids: torch.Tensor, max_new_tokens: int, **model_kwargs):
    """transformers' greedy generate on input ids [1, n] and the model's other inputs (pixel values, grids,
    mm_token_type_ids): (token ids, [log_softmax per generated token])."""
    from transformers import GenerationConfig

    model = hf_model(str(model_dir))
    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, generation_config=gen, output_logits=True, return_dict_in_generate=True,
                         attention_mask=torch.ones_like(ids), **model_kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [step[0].float().log_softmax(-1) for step in out.logits]
    return tokens, logprobs
