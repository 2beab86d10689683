"""Assembling the input processor for a model from the engine's settings."""
from __future__ import annotations

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.inputs.chat_template import load_chat_template
from engine.inputs.image_processor import ImageProcessor
from engine.inputs.processor import InputLimits, InputProcessor
from engine.inputs.tokenizer import load_tokenizer


def build_input_processor(args: EngineArgs, config: ModelConfig) -> InputProcessor:
    tokenizer = load_tokenizer(args.model)
    template = load_chat_template(args.model, tokenizer)
    image_processor = None
    if config.is_multimodal:
        kw = args.mm_processor_kwargs or {}
        image_processor = ImageProcessor.from_model_dir(args.model, min_pixels=kw.get("min_pixels"),
                                                        max_pixels=kw.get("max_pixels"))
    limits = InputLimits(max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                         limit_images_per_prompt=int((args.limit_mm_per_prompt or {}).get("image", 8)),
                         allow_remote_media=args.allow_remote_media,
                         allowed_local_media_path=args.allowed_local_media_path,
                         allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
                         max_pixels_per_request=args.max_pixels_per_request,
                         max_pixels_in_flight=args.max_pixels_in_flight,
                         max_prompt_text_bytes=int(args.max_prompt_text_mb * (1 << 20)),
                         max_prompt_text_bytes_in_flight=int(args.max_prompt_text_mb_in_flight * (1 << 20)))
    return InputProcessor(config, tokenizer, template, image_processor, limits)
