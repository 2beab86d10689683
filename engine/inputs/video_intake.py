"""A chat's video, from its URL to a ProcessedVideo: fetched through the media resolver images use, its header
checked (video_io), its frames sampled, decoded and resized (video_processor), cut into frame groups and hashed.

Memory is counted as images count it: against the request's pixels (413) and the in-flight budget (429), from
the header on, before a frame is decoded. A clip counts the pixels it holds once resized plus one frame at its
own size (the frame being decoded); a list of frames counts each frame as sent, since each is decoded whole.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from blake3 import blake3

from engine.errors import ImageError, PayloadTooLargeError
from engine.inputs.budget import PixelBudget, RequestPixels
from engine.inputs.chat_messages import VideoRef
from engine.inputs.image_cache import ImageCache
from engine.inputs.image_io import b64decode, decode_image, fetch_media_bytes, split_data_url
from engine.inputs.types import ProcessedVideo
from engine.inputs.video_io import OpenVideo, VideoLimits
from engine.inputs.video_processor import VideoProcessor

FRAME_LIST_MEDIA_TYPE = "video/jpeg"     # vLLM's name for a list of frames (any image format is decoded)
FRAME_LIST_FPS = 1.0                     # a frame list's frame rate when the request gives no fps (vLLM's)


@dataclass(frozen=True)
class MediaAccess:
    """Where URLs may point (the server's --allow-remote-media, --allowed-local-media-path) and the image limits
    each frame of a frame list is held to."""
    allow_remote: bool = False
    allowed_local_media_path: str | None = None
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 40_000_000


class VideoIntake:
    def __init__(self, limits: VideoLimits, access: MediaAccess, budget: PixelBudget, cache: ImageCache):
        self.limits, self.access, self.budget, self.cache = limits, access, budget, cache

    def load(self, ref: VideoRef, processor: VideoProcessor, pixels: RequestPixels,
             frames_fps: float | None = None) -> ProcessedVideo:
        """The video behind `ref`, processed by `processor` (the request's settings). `frames_fps`: the rate of
        a list of frames, for its timestamps (the request's fps)."""
        if ref.url[:5].lower() == "data:" and split_data_url(ref.url, "video", ref.param)[0] == FRAME_LIST_MEDIA_TYPE:
            return self._load_frame_list(ref, processor, pixels, frames_fps or FRAME_LIST_FPS)
        acc = self.access
        data = fetch_media_bytes(ref.url, max_bytes=self.limits.max_bytes, allow_remote=acc.allow_remote,
                                 allowed_local_media_path=acc.allowed_local_media_path, param=ref.param,
                                 media="video")
        counted = False

        def decode() -> ProcessedVideo:
            nonlocal counted
            with OpenVideo(data, self.limits, ref.param) as video, contextlib.ExitStack() as held:
                info = video.info
                indices = processor.sample_indices(info.num_frames, info.fps)
                height, width = _resized_size(processor, len(indices), info.height, info.width, ref.param)
                cost = len(indices) * height * width + info.width * info.height
                counted = True
                pixels.add(cost)
                held.enter_context(self.budget.hold(cost, ref.param))
                frames = video.decode(indices, lambda f: processor.resize(f[None], height, width)[0])
                return _finish(processor, torch.stack(frames), indices, info.fps, info.width * info.height)
        out = self.cache.get_or_process(data, decode, settings=_settings_key(processor))
        if not counted:              # from the cache: the request is still answered as if it decoded the clip
            pixels.add(sum(g.numel() // 3 for g in out.groups))
        return out

    def _load_frame_list(self, ref: VideoRef, processor: VideoProcessor, pixels: RequestPixels,
                         fps: float) -> ProcessedVideo:
        """data:video/jpeg;base64,<frame>,<frame>,...: the frames as sampled by the client, all of them used."""
        payload = split_data_url(ref.url, "video", ref.param)[1]
        if len(payload) // 4 * 3 > self.limits.max_bytes:
            raise PayloadTooLargeError(f"the frames are about {len(payload) // 4 * 3} bytes, over the limit of "
                                       f"{self.limits.max_bytes} bytes (--max-video-mb)", param=ref.param)
        parts = payload.split(",")
        if len(parts) > processor.max_frames:
            raise PayloadTooLargeError(f"{len(parts)} frames, over the limit of {processor.max_frames} "
                                       f"(max_frames); send fewer", param=ref.param, code="video_too_long")
        acc = self.access
        with contextlib.ExitStack() as held:
            def on_size(width: int, height: int) -> None:
                pixels.add(width * height)
                held.enter_context(self.budget.hold(width * height, ref.param))
            frames = []
            for i, part in enumerate(parts):
                where = f"{ref.param} frame {i}"
                image = decode_image(b64decode(part, acc.max_image_bytes, where), acc.max_image_bytes,
                                     acc.max_image_pixels, where, on_size=on_size)
                frame = torch.from_numpy(np.asarray(image))
                if frames and frame.shape != frames[0].shape:
                    raise ImageError(f"frame {i} is {frame.shape[1]}x{frame.shape[0]}, frame 0 is "
                                     f"{frames[0].shape[1]}x{frames[0].shape[0]}: a video's frames share one size",
                                     param=ref.param)
                frames.append(frame)
            video = torch.stack(frames)
            height, width = _resized_size(processor, len(frames), video.shape[1], video.shape[2], ref.param)
            indices = np.arange(len(frames))
            return _finish(processor, processor.resize(video, height, width), indices, fps,
                           video.shape[1] * video.shape[2])


def _resized_size(processor: VideoProcessor, num_frames: int, height: int, width: int,
                  param: str) -> tuple[int, int]:
    try:
        return processor.resized_size(num_frames, height, width)
    except ImageError as e:
        raise ImageError(e.message, param=param) from e


def _finish(processor: VideoProcessor, frames: torch.Tensor, indices: np.ndarray, fps: float,
            frame_pixels: int) -> ProcessedVideo:
    """Resized frames [n, h, w, 3] -> frame groups, their timestamps, grid and content hashes."""
    groups = tuple(processor.groups(frames))
    height, width = frames.shape[1:3]
    key = f"{tuple(groups[0].shape)}:{processor.cache_key}\0".encode()
    hashes = tuple(blake3(key).update(g.numpy().data).hexdigest() for g in groups)
    return ProcessedVideo(groups=groups, grid_thw=processor.group_grid(height, width),
                          timestamps=tuple(processor.timestamps(indices, fps)), content_hashes=hashes,
                          source_pixels=len(indices) * frame_pixels)


def _settings_key(processor: VideoProcessor) -> str:
    """Everything of the processor that decides what a clip becomes (the upload cache's second key)."""
    return repr(processor)
