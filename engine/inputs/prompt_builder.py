"""A tokenized prompt and its decoded media made into a ProcessedPrompt: each <|image_pad|> expanded to the
t*h*w / merge**2 tokens its image becomes after the vision encoder, exactly as the Qwen3-VL processor does, each
frame group's <|video_pad|> likewise (each group an item of its own), and for Qwen3-VL the 3-axis rotary
positions computed over the expanded prompt. Also the prompt cut to its last k tokens (truncate_prompt_tokens)."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.errors import InvalidInputError
from engine.inputs.mrope import get_mrope_positions
from engine.inputs.types import ImageItem, ProcessedImage, ProcessedPrompt, ProcessedVideo


def build_prompt(mc: ModelConfig, token_ids: list[int], images: list[ProcessedImage], text: str | None,
                 param: str = "prompt", videos: list[ProcessedVideo] = ()) -> ProcessedPrompt:
    if not mc.is_multimodal:
        if images:
            raise text_only_error(mc, "multi_modal_data")
        return ProcessedPrompt(prompt_token_ids=token_ids, prompt=text)
    image_id, video_id = mc.image_token_id, mc.video_token_id
    slots = [i for i, t in enumerate(token_ids) if t == image_id or t == video_id]
    groups = [(g, grid, h) for v in videos for g, grid, h in zip(v.groups, [v.grid_thw] * len(v.groups),
                                                                    v.content_hashes)]
    num_image_slots = sum(token_ids[i] == image_id for i in slots)
    if num_image_slots != len(images):
        raise InvalidInputError(
            f"the prompt has {num_image_slots} image placeholder(s) but {len(images)} image(s) were given; put "
            f"one <|vision_start|><|image_pad|><|vision_end|> in the prompt per image", param=param)
    if len(slots) - num_image_slots != len(groups):
        raise InvalidInputError(f"the prompt has {len(slots) - num_image_slots} video placeholder(s) but the "
                                f"videos given make {len(groups)} frame group(s); send videos as video_url "
                                f"parts of chat messages", param=param)
    merge = mc.vision.spatial_merge_size
    ids: list[int] = []
    items: list[ImageItem] = []
    prev = 0
    next_image, next_group = iter(images), iter(groups)
    for slot in slots:
        if token_ids[slot] == image_id:
            image = next(next_image)
            raw, grid, content_hash = image.raw, image.grid_thw, image.content_hash
        else:
            raw, grid, content_hash = next(next_group)
        t, h, w = grid
        length = t * h * w // merge ** 2
        ids += token_ids[prev:slot]
        items.append(ImageItem(raw=raw, grid_thw=grid, offset=len(ids), length=length, content_hash=content_hash))
        ids += [token_ids[slot]] * length
        prev = slot + 1
    ids += token_ids[prev:]
    positions, delta = get_mrope_positions(ids, [it.grid_thw for it in items], (image_id, video_id), merge)
    return ProcessedPrompt(prompt_token_ids=ids, prompt=text, images=items, mrope_positions=positions,
                           mrope_position_delta=delta)


def keep_last(mc: ModelConfig, prompt: ProcessedPrompt, k: int | None) -> ProcessedPrompt:
    """The prompt cut to its last k tokens (left truncation, as vLLM's), built again so that its positions start
    at 0; its text is no longer the prompt's, so it is dropped. A prompt with images or videos is not cut: the
    cut would split one or move every placeholder."""
    if k is None or len(prompt.prompt_token_ids) <= k:
        return prompt
    if prompt.images:
        raise InvalidInputError(f"truncate_prompt_tokens ({k}) would cut this prompt of "
                                f"{len(prompt.prompt_token_ids)} tokens, which holds images or videos; prompts "
                                f"with images or videos are not truncated", param="truncate_prompt_tokens")
    return build_prompt(mc, prompt.prompt_token_ids[-k:], [], None)


def text_only_error(mc: ModelConfig, param: str) -> InvalidInputError:
    return InvalidInputError(f"this model ({mc.architecture}) is text-only and does not accept images or videos",
                             param=param)
