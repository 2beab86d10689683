"""From what a request sends (text, token ids, chat messages, images, videos) to a ProcessedPrompt the engine
can run.

The prompt holds one <|image_pad|> per image (the chat template writes <|vision_start|><|image_pad|><|vision_end|>);
each is expanded to the t*h*w / merge**2 tokens its image becomes after the vision encoder, exactly as the
Qwen3-VL processor does, and for Qwen3-VL the 3-axis rotary positions are computed over the expanded prompt.
A video's <|vision_start|><|video_pad|><|vision_end|> is replaced in the rendered text, before tokenizing, by one
`<t seconds><|vision_start|><|video_pad|><|vision_end|>` per frame group (the Qwen3-VL processor's text); each
group's <|video_pad|> is then expanded like an image's, and each group is an item of its own (VideoIntake). The
expansion itself is engine/inputs/prompt_builder.py.
"""
from __future__ import annotations

import contextlib
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from blake3 import blake3
from PIL import Image
from transformers import PreTrainedTokenizerBase

from engine.config import ModelConfig
from engine.errors import ImageError, InvalidInputError, PromptTooLongError
from engine.inputs.budget import PixelBudget, RequestPixels, TextBudget, check_text_size, text_bytes
from engine.inputs.chat_messages import ImageRef, VideoRef, parse_chat_messages
from engine.inputs.chat_template import ChatTemplate, cut_after_final_message, request_template
from engine.inputs.image_cache import ImageCache
from engine.inputs.image_io import (DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, check_pixels,
                                    decode_image, fetch_image_bytes, image_size)
from engine.inputs.image_processor import ImageProcessor, image_hw
from engine.inputs.mm_kwargs import check_mm_processor_kwargs, image_processor_for
from engine.inputs.prompt_builder import build_prompt, keep_last, text_only_error
from engine.inputs.tool_text import tools_as_text, uses_tools
from engine.inputs.typed_specials import TypedSpecialTokens
from engine.inputs.types import ProcessedImage, ProcessedPrompt, ProcessedVideo
from engine.inputs.video_intake import MediaAccess, VideoIntake
from engine.inputs.video_io import VideoLimits
from engine.inputs.video_processor import VideoProcessor, placeholder_text

# _refuse_surely_too_long: characters per piece, and the tokens a cut between two pieces may add.
_PIECE_CHARS = 16384
_CUT_MARGIN_TOKENS = 2
# Names the template itself receives; a request's chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


@dataclass(frozen=True)
class ImageSource:
    """An image of a chat whose size is known and counted, not yet decoded."""
    ref: ImageRef
    data: bytes | None          # the fetched bytes; None for an image given decoded (offline)


@dataclass(frozen=True)
class InputLimits:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS    # of the image as sent, before resizing
    limit_images_per_prompt: int = 8                    # vLLM: --limit-mm-per-prompt
    limit_videos_per_prompt: int = 1
    video: VideoLimits = VideoLimits()
    allow_remote_media: bool = False                    # http(s) image URLs
    allowed_local_media_path: str | None = None         # file:// image URLs under this directory
    image_cache_bytes: int = 256 * 2**20                # processed uploads kept for re-sent chat history
    allow_special_tokens_in_messages: bool = False      # typed <|im_start|> etc. in message text become tokens
    max_pixels_per_request: int | None = 80_000_000     # pixels one request's images decode to (413 past it)
    max_pixels_in_flight: int | None = 160_000_000      # pixels decoded at once over all requests (429 past it)
    max_prompt_text_bytes: int | None = 8 << 20         # UTF-8 bytes of one request's prompt text (413 past it)
    max_prompt_text_bytes_in_flight: int | None = 32 << 20   # prompt text rendered and tokenized at once (429)


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase,
                 chat_template: ChatTemplate | None, image_processor: ImageProcessor | None = None,
                 limits: InputLimits | None = None, video_processor: VideoProcessor | None = None):
        if model_config.is_multimodal and image_processor is None:
            raise ValueError(f"{model_config.architecture} takes images: pass an ImageProcessor")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_processor = image_processor if model_config.is_multimodal else None
        self.video_processor = (video_processor or VideoProcessor()) if model_config.is_multimodal else None
        self.limits = lim = limits or InputLimits()
        self.image_cache = ImageCache(lim.image_cache_bytes)
        self.typed_specials = TypedSpecialTokens(tokenizer)
        self.pixel_budget = PixelBudget(lim.max_pixels_in_flight)
        self.video_intake = VideoIntake(lim.video, MediaAccess(lim.allow_remote_media, lim.allowed_local_media_path,
                                                               lim.max_image_bytes, lim.max_image_pixels),
                                        self.pixel_budget, self.image_cache)
        self.text_budget = TextBudget(self.limits.max_prompt_text_bytes_in_flight)
        # The engine's max_model_len, once known: a text that surely tokenizes past it is refused before it is
        # tokenized in full (a 30 MB prompt would otherwise take seconds and gigabytes to be refused).
        self.max_prompt_tokens: int | None = None
        # The input side's one pool: the server processes prompts on it (AsyncLLM), and a chat's images load on it
        # all at once, several requests' at once, while the prompt's own thread renders and tokenizes.
        self.executor = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4),
                                           thread_name_prefix="input")

    def shutdown(self) -> None:
        """Stop the executor: queued work is dropped, running work finishes on its own."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- entry points ---------------------------------------------------------------------------------------
    def process(self, prompt: str | dict[str, Any], truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """A completion prompt: a string (tokenized with the tokenizer's special tokens, e.g. BOS, as vLLM does),
        {"prompt_token_ids": [...]}, or {"prompt": str, "multi_modal_data": {"image": image | [images]}}.
        truncate_prompt_tokens: only the prompt's last k tokens are kept (vLLM's)."""
        return keep_last(self.model_config, self._process(prompt), truncate_prompt_tokens)

    def _process(self, prompt: str | dict[str, Any]) -> ProcessedPrompt:
        if isinstance(prompt, str):
            with self._text_held(prompt, "prompt"):
                return build_prompt(self.model_config, self._encode(prompt, add_special_tokens=True), [], prompt)
        if not isinstance(prompt, dict):
            raise InvalidInputError(f"prompt must be a string or a dict, got {type(prompt).__name__}",
                                    param="prompt")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise InvalidInputError(f"unknown prompt field(s) {sorted(unknown)}; expected prompt or "
                                    f"prompt_token_ids, and optionally multi_modal_data", param="prompt")
        images = self._images_from_mm_data(prompt.get("multi_modal_data"))
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidInputError("give exactly one of prompt and prompt_token_ids", param="prompt")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidInputError("prompt must be a string", param="prompt")
            with self._text_held(text, "prompt"):
                return build_prompt(self.model_config, self._encode(text, add_special_tokens=True), images, text)
        return build_prompt(self.model_config, self._check_token_ids(prompt["prompt_token_ids"]), images, None)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, as /tokenize gives them: under the prompt-text budgets of a prompt (413 past the
        per-request cap, 429 past the in-flight one), but neither an empty text nor one past max_model_len is an
        error here (the answer's count says so)."""
        with self._text_held(text, "prompt"):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def process_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                     continue_final_message: bool = False, mm_processor_kwargs: dict[str, Any] | None = None,
                     truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """OpenAI-style chat messages, rendered with the model's chat template (or the request's own
        `chat_template`, in the same sandbox) and tokenized without added special tokens (the template writes
        them), as apply_chat_template does. continue_final_message: the prompt ends where the last message's
        text ends, for the model to continue that message. mm_processor_kwargs: the request's own image and
        video processor settings (engine/inputs/mm_kwargs.py). truncate_prompt_tokens: only the rendered prompt's
        last k tokens are kept (vLLM's)."""
        template = self.chat_template if chat_template is None else request_template(chat_template)
        if template is None:
            raise InvalidInputError("this model has no chat template; send a raw prompt to /v1/completions instead, "
                                    "or a chat_template", param="messages")
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None and self.chat_template is not None:   # the tokenizer's special tokens too
            kwargs = {**self.chat_template.default_kwargs, **kwargs}
        bad = [k for k in kwargs if not isinstance(k, str) or k in _RESERVED_TEMPLATE_KWARGS]
        if bad:
            raise InvalidInputError(f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidInputError("tools must be a list of objects", param="tools")
        chat = parse_chat_messages(messages, template.content_format)
        if not template.knows_tools and uses_tools(chat.messages, tools):
            chat.messages, tools = tools_as_text(chat.messages, tools), None
        media = chat.images + chat.videos
        if media and not self.model_config.is_multimodal:
            raise text_only_error(self.model_config, media[0].param)
        self._check_image_count(len(chat.images), "messages")
        self._check_video_count(len(chat.videos), "messages")
        mm_kwargs = check_mm_processor_kwargs(mm_processor_kwargs)
        image_proc = image_processor_for(self.image_processor, mm_kwargs, "mm_processor_kwargs") if media else None
        video_proc = self.video_processor.with_kwargs(mm_kwargs, "mm_processor_kwargs", self.video_processor) \
            if chat.videos else None
        with self._text_held((chat.messages, tools, kwargs), "messages"):
            # Every image's size is read from its header and counted first: a request refused for its images
            # decodes none of them, nor any video. Then images and videos load on the executor, all at once, while
            # this thread renders; the videos are awaited before tokenizing (their timestamps are text), the images
            # after. A template error still wins over a media error, and loads not started by then are not started.
            pixels = RequestPixels(self.limits.max_pixels_per_request, "messages")
            sources = [self._image_source(ref, pixels, image_proc) for ref in chat.images]
            pending_videos = [self.executor.submit(self.video_intake.load, ref, video_proc, pixels,
                                                   mm_kwargs.get("fps")) for ref in chat.videos]
            pending = [self.executor.submit(self._load_image, source, image_proc) for source in sources]
            try:
                videos: list[ProcessedVideo] = []

                def expand_videos(rendered: str) -> str:
                    videos.extend(self._finish_video(p, ref, pixels, video_proc, mm_kwargs.get("fps"))
                                  for p, ref in zip(pending_videos, chat.videos))
                    return self._expand_video_text(rendered, videos)
                text, token_ids = self._render_chat(template, chat.messages, add_generation_prompt, tools, kwargs,
                                                    continue_final_message, expand_videos if chat.videos else None)
                images = [self._finish_loading(p, source, image_proc) for p, source in zip(pending, sources)]
            finally:
                for p in pending + pending_videos:
                    p.cancel()
            prompt = build_prompt(self.model_config, token_ids, images, text, param="messages", videos=videos)
            return keep_last(self.model_config, prompt, truncate_prompt_tokens)

    def _text_held(self, text: Any, param: str) -> contextlib.AbstractContextManager:
        """The prompt text's share of the in-flight text budget while it is rendered and tokenized, once it is
        checked against the per-request cap (413): both before anything reads the text."""
        size = text_bytes(text)
        check_text_size(size, self.limits.max_prompt_text_bytes, param)
        return self.text_budget.hold(size, param)

    def _render_chat(self, template: ChatTemplate, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], continue_final_message: bool,
                     transform=None) -> tuple[str, list[int]]:
        """The rendered prompt (passed through `transform` before it is tokenized) and its token ids.
        Special-token strings the request typed (in messages, tools or template kwargs) are tokenized as text,
        so that control tokens come only from the template."""
        markers: dict[str, str] = {}
        if not self.limits.allow_special_tokens_in_messages:
            (messages, tools, kwargs), markers = self.typed_specials.mask((messages, tools, kwargs))
        rendered = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if continue_final_message:
            rendered = cut_after_final_message(rendered, messages[-1])
        if transform is not None:
            rendered = transform(rendered)
        if not markers:
            return rendered, self._encode(rendered, add_special_tokens=False, param="messages")
        if not rendered:
            raise InvalidInputError("the prompt is empty", param="prompt")
        self._refuse_surely_too_long(rendered, "messages")
        return self.typed_specials.unmask(rendered, markers), self._check_token_ids(
            self.typed_specials.encode(rendered, markers))

    def _encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        if not text:
            raise InvalidInputError("the prompt is empty", param="prompt")
        self._refuse_surely_too_long(text, param)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidInputError("the prompt is empty after tokenization", param="prompt")
        return self._check_token_ids(ids)

    def _refuse_surely_too_long(self, text: str, param: str) -> None:
        """Tokenize a long text piece by piece (cut before a space, where the pre-tokenizer cuts too) and stop
        as soon as the pieces alone hold more tokens than max_prompt_tokens, with a margin for the cuts. A text
        of at most max_prompt_tokens / 4 characters is not looked at: no character becomes more than 4 tokens."""
        limit = self.max_prompt_tokens
        if limit is None or len(text) * 4 <= limit:
            return
        count, pieces, start = 0, 0, 0
        while start < len(text):
            end = start + _PIECE_CHARS
            if end < len(text):
                space = text.rfind(" ", start + _PIECE_CHARS // 2, end)
                end = space if space > start else end
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            pieces += 1
            start = end
            if count > limit + _CUT_MARGIN_TOKENS * pieces:
                raise PromptTooLongError(
                    f"this model's maximum context length is {limit} tokens, but the prompt has more than {count} "
                    f"tokens (it is {len(text)} characters; counting stopped there); shorten the prompt",
                    param=param, code="context_length")

    def _check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidInputError("prompt_token_ids must be a non-empty list of integers", param="prompt")
        if not all(type(t) is int for t in ids):   # bool is an int subclass; it is not a token id
            raise InvalidInputError("prompt_token_ids must contain only integers", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInputError(f"token id {bad} is out of the vocabulary [0, {vocab})", param="prompt")
        return list(ids)

    # ---- images ---------------------------------------------------------------------------------------------
    def _images_from_mm_data(self, mm_data: Any) -> list[ProcessedImage]:
        if mm_data is None:
            return []
        if not isinstance(mm_data, dict) or set(mm_data) - {"image"}:
            raise InvalidInputError("multi_modal_data must be {\"image\": image or [images]}; only images are "
                                    "supported", param="multi_modal_data")
        images = mm_data.get("image")
        images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
        if images and not self.model_config.is_multimodal:
            raise text_only_error(self.model_config, "multi_modal_data")
        self._check_image_count(len(images), "multi_modal_data")
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise InvalidInputError(f"multi_modal_data.image[{i}] must be a PIL image, "
                                        f"got {type(image).__name__}", param="multi_modal_data")
        return [self._process_image(image, f"multi_modal_data.image[{i}]") for i, image in enumerate(images)]

    def _finish_loading(self, loading: Future, source: ImageSource,
                        processor: ImageProcessor | None = None) -> ProcessedImage:
        """The loaded image. A load still queued runs on this thread instead: process_chat itself runs on the
        executor in the server, and a worker that waited for work queued behind it could wait forever once every
        worker did."""
        return self._load_image(source, processor) if loading.cancel() else loading.result()

    def _finish_video(self, loading: Future, ref: VideoRef, pixels: RequestPixels, processor: VideoProcessor,
                      fps: float | None) -> ProcessedVideo:
        """The loaded video (a load still queued runs on this thread, as _finish_loading says)."""
        return self.video_intake.load(ref, processor, pixels, fps) if loading.cancel() else loading.result()

    def _expand_video_text(self, rendered: str, videos: list[ProcessedVideo]) -> str:
        """Each video's placeholder (the template's <|vision_start|><|video_pad|><|vision_end|>, or a bare
        <|video_pad|>) replaced by its groups' timestamps and placeholders, in order."""
        start, pad, end = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"
        found = iter(videos)

        def one(match: re.Match) -> str:
            video = next(found, None)
            return match.group(0) if video is None else placeholder_text(list(video.timestamps), start, pad, end)
        return _VIDEO_PLACEHOLDER.sub(one, rendered)

    def _image_source(self, ref: ImageRef, pixels: RequestPixels,
                      processor: ImageProcessor | None = None) -> ImageSource:
        """An image's bytes and its size from the header, counted against the request's pixels (413) whether or
        not the cache holds it, so that the answer does not depend on the cache: no pixel is decoded here."""
        processor = processor or self.image_processor
        if ref.image is not None:
            width, height = ref.image.size
        else:
            lim = self.limits
            data = fetch_image_bytes(ref.url, max_bytes=lim.max_image_bytes, allow_remote=lim.allow_remote_media,
                                     allowed_local_media_path=lim.allowed_local_media_path, param=ref.param)
            width, height = image_size(data, lim.max_image_pixels, ref.param)
        try:
            processor.resized_size(height, width)     # its shape rules (aspect ratio), from the size
        except ImageError as e:
            raise ImageError(e.message, param=ref.param) from e
        pixels.add(width * height)
        return ImageSource(ref, None if ref.image is not None else data)

    def _load_image(self, source: ImageSource, processor: ImageProcessor | None = None) -> ProcessedImage:
        """bytes -> Pillow decode -> the image processor, or the result kept for these bytes. The decode holds
        its share of the in-flight pixel budget (429) from its header on."""
        processor = processor or self.image_processor
        ref = source.ref
        if ref.image is not None:
            return self._process_image(ref.image, ref.param, processor)
        lim, data = self.limits, source.data

        def on_size(width: int, height: int) -> None:
            held.enter_context(self.pixel_budget.hold(width * height, ref.param))
        with contextlib.ExitStack() as held:     # the decode's share of the pixel budget, from its header on
            return self.image_cache.get_or_process(data, lambda: self._process_image(decode_image(
                data, lim.max_image_bytes, lim.max_image_pixels, ref.param, on_size=on_size), ref.param, processor),
                settings="" if processor is self.image_processor else processor.cache_key)

    def _process_image(self, image: Image.Image | np.ndarray, param: str,
                       processor: ImageProcessor | None = None) -> ProcessedImage:
        """The image checked against the limits and the resize rules (errors name `param`), resized to the
        patch grid, and its content hash."""
        processor = processor or self.image_processor
        height, width = image_hw(image)
        check_pixels(width, height, self.limits.max_image_pixels, param)
        try:
            raw, grid = processor.resize(image)
        except ImageError as e:
            raise ImageError(e.message, param=param) from e
        return ProcessedImage(raw=raw, grid_thw=grid, content_hash=self._content_hash(raw, processor),
                              source_pixels=width * height)

    def _check_image_count(self, n: int, param: str) -> None:
        if n > self.limits.limit_images_per_prompt:
            raise InvalidInputError(f"{n} images in one prompt, over the limit of "
                                    f"{self.limits.limit_images_per_prompt} (--limit-mm-per-prompt)", param=param)

    def _check_video_count(self, n: int, param: str) -> None:
        if n > self.limits.limit_videos_per_prompt:
            raise InvalidInputError(f"{n} videos in one prompt, over the limit of "
                                    f"{self.limits.limit_videos_per_prompt} (--limit-mm-per-prompt)", param=param)

    def _content_hash(self, raw: torch.Tensor, processor: ImageProcessor) -> str:
        """Identifies what the vision encoder will see (the resized pixels and how they are normalized): the
        prefix-cache and encoder-cache key. Two uploads that resize to the same pixels share it, rightly."""
        key = blake3(f"{tuple(raw.shape)}:{processor.cache_key}\0".encode())
        return key.update(raw.numpy().data).hexdigest()



_VIDEO_PLACEHOLDER = re.compile(re.escape("<|vision_start|><|video_pad|><|vision_end|>") + "|"
                                + re.escape("<|video_pad|>"))
