"""Video bytes in, the sampled frames out, without trusting the sender (PyAV: FFmpeg's demuxers and decoders).

Everything the container's header says is checked before a frame is decoded: a video stream exists, its
duration, its frame count and its frame size are within the limits. Only the frames up to the last one sampled
are decoded, only the sampled ones are converted to RGB, and each is resized as soon as it is decoded, so a
request holds its resized frames plus one frame at the clip's size. Decoding stops at a deadline and at the
frame count the header promised; a stream that ends early, or whose frames are not the size it declared, is a
400 naming the field.

A frame index is the frame's place in presentation order, counted from the first frame decoded: what
transformers' PyAV reader counts.
"""
from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
import torch

from engine.errors import ImageError, PayloadTooLargeError

# Container formats a request's video may be in: what phones, browsers and screen recorders write.
ALLOWED_FORMATS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpegts", "gif", "flv", "ogg"})


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 64 << 20               # of the file
    max_seconds: float = 1200.0             # of the clip, from its header
    max_frames: int = 36_000                # in the clip, from its header (20 minutes at 30 fps)
    max_frame_pixels: int = 40_000_000      # width x height of one frame
    decode_timeout_s: float = 30.0          # wall time of one clip's decode


@dataclass(frozen=True)
class VideoInfo:
    """What the container's header says about its first video stream."""
    num_frames: int
    fps: float
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


class OpenVideo:
    """A parsed container whose header passed the limits (`info`); `decode` reads its frames once."""

    def __init__(self, data: bytes, limits: VideoLimits, param: str | None):
        self.param, self.limits = param, limits
        if not data:
            raise ImageError("the video is empty (0 bytes)", param=param)
        if len(data) > limits.max_bytes:
            raise PayloadTooLargeError(f"video is {len(data)} bytes, over the limit of {limits.max_bytes} bytes "
                                       f"(--max-video-mb); send a shorter or smaller clip", param=param)
        try:
            self.container = av.open(io.BytesIO(data), mode="r")
        except av.FFmpegError as e:
            raise ImageError(f"could not read the video: not a video file, or corrupt or truncated ({e})",
                             param=param) from e
        try:
            self.info = self._check_header()
        except BaseException:
            self.close()
            raise

    def _check_header(self) -> VideoInfo:
        param, lim, c = self.param, self.limits, self.container
        if c.format.name not in ALLOWED_FORMATS:
            raise ImageError(f"video container {c.format.name!r} is not accepted; send MP4, WebM, MKV, MOV, AVI, "
                             f"MPEG-TS, FLV, Ogg or GIF", param=param)
        if not c.streams.video:
            kinds = sorted({s.type for s in c.streams}) or ["nothing"]
            raise ImageError(f"the file has no video stream (it holds {', '.join(kinds)})", param=param)
        stream = c.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        seconds = (float(stream.duration * stream.time_base) if stream.duration and stream.time_base
                   else (c.duration or 0) / av.time_base)
        frames = int(stream.frames) or int(round(seconds * fps))
        width, height = stream.codec_context.width, stream.codec_context.height
        if fps <= 0 or frames <= 0:
            raise ImageError("the video's header gives no frame rate or frame count; re-encode it (e.g. to MP4)",
                             param=param)
        seconds = max(seconds, frames / fps)
        if seconds > lim.max_seconds:
            raise PayloadTooLargeError(f"the video is {seconds:.0f} s long, over the limit of {lim.max_seconds:.0f} s "
                                       f"(--max-video-seconds); cut it", param=param, code="video_too_long")
        if frames > lim.max_frames:
            raise PayloadTooLargeError(f"the video has {frames} frames, over the limit of {lim.max_frames} "
                                       f"(--max-video-frames); lower its frame rate or cut it", param=param,
                                       code="video_too_long")
        if width <= 0 or height <= 0:
            raise ImageError(f"the video's frames are {width}x{height}: they have no pixels", param=param)
        if width * height > lim.max_frame_pixels:
            raise PayloadTooLargeError(f"the video's frames are {width}x{height} = {width * height} pixels, over the "
                                       f"limit of {lim.max_frame_pixels} (--max-image-pixels); downscale it",
                                       param=param, code="too_many_pixels")
        if not stream.frames:        # WebM/MKV headers give no count: count the packets (no decoding), rewind
            frames = sum(1 for packet in c.demux(stream) if packet.size)
            c.seek(0)
            if not 0 < frames <= lim.max_frames:
                raise PayloadTooLargeError(f"the video has {frames} frames; the limit is {lim.max_frames} "
                                           f"(--max-video-frames)", param=param, code="video_too_long")
        return VideoInfo(num_frames=frames, fps=fps, width=width, height=height)

    def decode(self, indices: np.ndarray, resize: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """The frames at `indices` (sorted; repeats allowed), each uint8 [H, W, 3] passed through `resize` as
        soon as it is decoded, in the order of `indices`."""
        param, info = self.param, self.info
        stream = self.container.streams.video[0]
        stream.thread_type = "AUTO"          # FFmpeg's frame and slice threads: one clip decodes on several cores
        wanted = np.asarray(indices, dtype=np.int64)
        last = int(wanted[-1])
        deadline = time.monotonic() + self.limits.decode_timeout_s
        out: list[torch.Tensor] = []
        k, index = 0, -1
        try:
            for index, frame in enumerate(self.container.decode(stream)):
                if time.monotonic() > deadline:
                    raise PayloadTooLargeError(
                        f"decoding the video took over {self.limits.decode_timeout_s:.0f} s (at frame {index} of "
                        f"{last + 1} needed); send a shorter or smaller clip", param=param, code="video_too_long")
                if index > last:
                    break
                if wanted[k] != index:
                    continue
                if (frame.width, frame.height) != (info.width, info.height):
                    raise ImageError(f"frame {index} is {frame.width}x{frame.height}, but the video's header says "
                                     f"{info.width}x{info.height}", param=param)
                resized = resize(torch.from_numpy(frame.to_ndarray(format="rgb24")))
                while k < len(wanted) and wanted[k] == index:
                    out.append(resized)
                    k += 1
                if k == len(wanted):
                    break
        except av.FFmpegError as e:
            raise ImageError(f"the video is corrupt at frame {index + 1}: {e}", param=param) from e
        if k < len(wanted):
            raise ImageError(f"the video ended after {index + 1} frames, but its header says {info.num_frames}: it is "
                             f"truncated or corrupt", param=param)
        return out

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> "OpenVideo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
