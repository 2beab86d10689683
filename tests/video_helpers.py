"""Clips for the video tests, written with PyAV (libx264 in an MP4 unless asked otherwise), and their data URLs."""
from __future__ import annotations

import base64
import io

import av
import numpy as np


def synthetic_frame(i: int, width: int, height: int) -> np.ndarray:
    """Frame i of a moving pattern: a colour ramp that shifts with i and a bar that slides across."""
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([(x * 255 // max(width - 1, 1) + 7 * i) % 256, (y * 255 // max(height - 1, 1)) % 256,
                      np.full_like(x, (31 * i) % 256)], axis=-1).astype(np.uint8)
    bar = (i * 5) % max(width - 8, 1)
    frame[:, bar:bar + 8] = 255
    return frame


def make_clip(num_frames: int, fps: int = 10, width: int = 96, height: int = 64, codec: str = "libx264",
              container: str = "mp4", gop: int | None = None) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        for i in range(num_frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(synthetic_frame(i, width, height), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def video_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def frames_url(frames: list[bytes]) -> str:
    """vLLM's shape for frames sampled by the client: data:video/jpeg;base64,<frame>,<frame>,..."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}
