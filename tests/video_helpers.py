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
    """`gop`: a keyframe every `gop` frames and nowhere else (no scene-cut keyframes)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        options = {"x264-params": "scenecut=0"} if gop is not None and codec == "libx264" else {}
        stream = out.add_stream(codec, rate=fps, options=options)
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


def repeated_packet_clip(num_frames: int, fps: int = 1000, side: int = 16) -> bytes:
    """An H.264 MP4 of `num_frames` frames made without encoding them all: one keyframe, then one
    'nothing changed' frame's packet muxed again and again (100k frames in under a second and ~1 MB)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "bframes": "0"})
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")
        packets = []
        for i in range(2):
            frame.pts = i
            packets += stream.encode(frame)
        packets += stream.encode()
        key, unchanged, time_base = bytes(packets[0]), bytes(packets[1]), packets[0].time_base
        for i in range(num_frames):
            packet = av.Packet(key if i == 0 else unchanged)
            packet.pts = packet.dts = i
            packet.time_base, packet.stream, packet.is_keyframe = time_base, stream, i == 0
            out.mux(packet)
    return buf.getvalue()


def huge_frame_clip(width: int = 8000, height: int = 6000) -> bytes:
    """One blank Motion-JPEG frame of width x height in an AVI."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mjpeg", rate=1)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p"
        for packet in stream.encode(av.VideoFrame(width, height, "yuvj420p")):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def audio_only_clip(seconds: float = 1.0) -> bytes:
    """An MP4 (M4A) holding one AAC stream of silence and no video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        samples = int(16000 * seconds)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, samples), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
