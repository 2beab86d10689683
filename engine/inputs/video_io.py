"""Video bytes in, the sampled frames out, without trusting the sender (PyAV: FFmpeg's demuxers and decoders).

Everything the container's header says is checked before a frame is decoded: a video stream exists, its
duration, its frame count and its frame size are within the limits. Only the frames up to the last one sampled
are decoded, only the sampled ones are converted to RGB, and each is resized as soon as it is decoded, so a
request holds its resized frames plus one frame at the clip's size. Decoding stops at a deadline and at the
frame count the header promised; a stream that ends early, or whose frames are not the size it declared, is a
400 naming the field.

A frame index is the frame's place in presentation order, counted from the first frame: what transformers' PyAV
reader counts as it decodes. Here it is the rank of the frame's pts among the stream's packets (read without
decoding), which lets the decoder seek from keyframe to keyframe over frames nobody asked for.
"""
from __future__ import annotations

import bisect
import io
import time
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
import torch

from engine.errors import ImageError, PayloadTooLargeError

SEEK_MIN_GAP = 16      # frames: below this, decoding on is cheaper than a seek (a decoder flush and refill)
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
class _Packets:
    pts: list[int]                  # of every frame, in presentation order
    index: dict[int, int]           # pts -> presentation index
    keyframes: list[int]            # presentation indices of the keyframes

    def keyframe_before(self, index: int) -> int:
        """The last keyframe at or before frame `index` (0 before the first)."""
        at = bisect.bisect_right(self.keyframes, index) - 1
        return self.keyframes[at] if at >= 0 else 0


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
        self.frames_decoded = 0
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
        soon as it is decoded, in the order of `indices`. Where the next wanted frame's keyframe lies more than
        SEEK_MIN_GAP frames ahead, the decoder seeks to that keyframe instead of decoding the frames between."""
        stream = self.container.streams.video[0]
        stream.thread_type = "AUTO"          # FFmpeg's frame and slice threads: one clip decodes on several cores
        wanted = sorted({int(i) for i in indices})
        plan = self._scan()
        deadline = time.monotonic() + self.limits.decode_timeout_s
        got: dict[int, torch.Tensor] = {}
        k, index, floor = 0, -1, 0
        try:
            while k < len(wanted):
                sought = False
                for count, frame in enumerate(self.container.decode(stream), start=index + 1):
                    index = plan.index[frame.pts] if plan is not None else count
                    self._check_frame(frame, index, wanted[-1], deadline)
                    if index >= floor and index == wanted[k]:
                        got[index] = resize(torch.from_numpy(frame.to_ndarray(format="rgb24")))
                        k += 1
                    if k == len(wanted) or index > wanted[-1]:
                        break
                    key = plan.keyframe_before(wanted[k]) if plan is not None else 0
                    if key > index + SEEK_MIN_GAP and key > floor:     # each keyframe sought once at most
                        self.container.seek(plan.pts[key], stream=stream, backward=True, any_frame=False)
                        stream.codec_context.flush_buffers()
                        floor, sought = key, True     # frames shown before the keyframe may lack references
                        break
                if not sought:
                    break
        except av.FFmpegError as e:
            raise ImageError(f"the video is corrupt at frame {index + 1}: {e}", param=self.param) from e
        except KeyError:
            raise ImageError("the video's frames do not match its packets", param=self.param) from None
        if k < len(wanted):
            raise ImageError(f"the video ended after {index + 1} frames, but its header says {self.info.num_frames}: "
                             f"it is truncated or corrupt", param=self.param)
        return [got[int(i)] for i in indices]

    def _check_frame(self, frame: av.VideoFrame, index: int, last: int, deadline: float) -> None:
        info, param = self.info, self.param
        self.frames_decoded += 1
        if time.monotonic() > deadline:
            raise PayloadTooLargeError(f"decoding the video took over {self.limits.decode_timeout_s:.0f} s (at frame "
                                       f"{index} of {last + 1} needed); send a shorter or smaller clip", param=param,
                                       code="video_too_long")
        if (frame.width, frame.height) != (info.width, info.height):
            raise ImageError(f"frame {index} is {frame.width}x{frame.height}, but the video's header says "
                             f"{info.width}x{info.height}", param=param)

    def _scan(self) -> "_Packets | None":
        """The stream's packets read once (no decoding), then rewound: each frame's presentation index is the rank
        of its pts. None where the packets cannot say (a packet without pts, two with one pts, a count unlike the
        header's): frames are then counted as they are decoded, from the start, without seeking."""
        stream = self.container.streams.video[0]
        pts, keys = [], []
        for packet in self.container.demux(stream):
            if packet.size:
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keys.append(packet.pts)
        self.container.seek(0)
        if None in pts or len(set(pts)) != len(pts) or len(pts) != self.info.num_frames:
            return None
        order = sorted(pts)
        index = {p: i for i, p in enumerate(order)}
        return _Packets(pts=order, index=index, keyframes=sorted(index[p] for p in keys))

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> "OpenVideo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
