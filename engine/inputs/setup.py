"""Assembling the input processor for a model from the engine's settings."""
from __future__ import annotations

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.inputs.chat_template import load_chat_template
from engine.inputs.image_processor import ImageProcessor
from engine.inputs.mm_kwargs import check_mm_processor_kwargs, image_bounds
from engine.inputs.processor import InputLimits, InputProcessor
from engine.inputs.tokenizer import load_tokenizer
from engine.inputs.video_io import VideoLimits
from engine.inputs.video_processor import VideoProcessor


def build_input_processor(args: EngineArgs, config: ModelConfig) -> InputProcessor:
    tokenizer = load_tokenizer(args.model)
    template = load_chat_template(args.model, tokenizer)
    image_processor = video_processor = None
    kw = check_mm_processor_kwargs(args.mm_processor_kwargs or {}, "--mm-processor-kwargs")
    if config.is_multimodal:
        image_processor = ImageProcessor.from_model_dir(args.model, *image_bounds(kw))
        video_processor = VideoProcessor.from_model_dir(args.model).with_kwargs(kw, "--mm-processor-kwargs")
        _check_shared_normalization(image_processor, video_processor)
    limit = args.limit_mm_per_prompt or {}
    limits = InputLimits(max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                         limit_images_per_prompt=int(limit.get("image", 8)),
                         limit_videos_per_prompt=int(limit.get("video", 2)),
                         video=VideoLimits(max_bytes=int(args.max_video_mb * (1 << 20)),
                                           max_seconds=args.max_video_seconds, max_frames=args.max_video_frames,
                                           max_frame_pixels=args.max_image_pixels,
                                           decode_timeout_s=args.video_decode_timeout_s),
                         allow_remote_media=args.allow_remote_media,
                         allowed_local_media_path=args.allowed_local_media_path,
                         allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
                         max_pixels_per_request=args.max_pixels_per_request,
                         max_pixels_in_flight=args.max_pixels_in_flight,
                         max_prompt_text_bytes=int(args.max_prompt_text_mb * (1 << 20)),
                         max_prompt_text_bytes_in_flight=int(args.max_prompt_text_mb_in_flight * (1 << 20)))
    return InputProcessor(config, tokenizer, template, image_processor, limits, video_processor)


def _check_shared_normalization(image: ImageProcessor, video: VideoProcessor) -> None:
    """The runner normalizes a video's frames with the image processor's mean, std and rescale factor
    (ImageProcessor.to_pixel_values), so the two processors must agree on them, as Qwen3-VL's do."""
    ours = (image.image_mean, image.image_std, image.rescale_factor, image.patch_size, image.merge_size,
            image.temporal_patch_size)
    theirs = (video.image_mean, video.image_std, video.rescale_factor, video.patch_size, video.merge_size,
              video.temporal_patch_size)
    if ours != theirs:
        raise ModelLoadError(f"the model's video processor normalizes or patches frames unlike its image processor "
                             f"({theirs} against {ours}); this engine needs them to agree")
