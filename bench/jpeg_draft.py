"""Whether Pillow's JPEG draft mode (libjpeg's DCT scaling: decode at 1/2, 1/4 or 1/8 size) pays for oversized
JPEGs: decode + resize to the image processor's grid, ms, with and without draft(), and how far the drafted
pixels are from the reference (full decode, then the bicubic resize transformers' processor does). The parity
tests require the resized pixels to be equal, so any difference disqualifies it.

    python bench/jpeg_draft.py [--max-pixels 1003520] [--repeats 9]
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import synthetic_image  # noqa: E402

from engine.inputs.image_processor import ImageProcessor  # noqa: E402


def decode_and_resize(data: bytes, processor: ImageProcessor, draft: bool) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    height, width = processor.resized_size(image.height, image.width)
    if draft:
        image.draft("RGB", (width, height))     # the smallest DCT scale that still covers the target size
    image = image.convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    return np.asarray(image)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-pixels", type=int, nargs="+", default=[16_777_216, 1_003_520],
                    help="the processor's pixel cap (16777216: Qwen3-VL's own; 1003520: a server cap)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    sizes = [(4000, 3000), (1280, 960)]
    jpegs = {}
    for width, height in sizes:
        buf = io.BytesIO()
        synthetic_image(width, height, 0, "photo").save(buf, format="JPEG", quality=90)
        jpegs[(width, height)] = buf.getvalue()
    for cap in args.max_pixels:
        processor = ImageProcessor(max_pixels=cap)
        for (width, height), data in jpegs.items():
            times = {False: [], True: []}
            for _ in range(args.repeats):
                for draft in (False, True):
                    t0 = time.perf_counter()
                    decode_and_resize(data, processor, draft)
                    times[draft].append((time.perf_counter() - t0) * 1e3)
            ref = decode_and_resize(data, processor, False).astype(np.int16)
            diff = np.abs(decode_and_resize(data, processor, True).astype(np.int16) - ref)
            target = processor.resized_size(height, width)
            print(f"max_pixels {cap}: {width}x{height} JPEG ({len(data) / 1e6:.2f} MB) -> {target[1]}x{target[0]}: "
                  f"full decode {np.median(times[False]):.1f} ms, draft {np.median(times[True]):.1f} ms; "
                  f"drafted pixels differ in {np.mean(diff > 0) * 100:.1f}% of values (max {diff.max()}, "
                  f"mean {diff.mean():.2f})")


if __name__ == "__main__":
    main()
