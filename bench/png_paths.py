"""The host's PNG decode of one 1024x1024 upload through each path engine/inputs/png.py can take, on the same
images: ISA-L band by band (unfiltering in a worker behind the inflate), libdeflate whole (then bands
unfiltered one after another), and libspng alone (its own zlib). Medians over fresh images, ms. With --old,
the decode as the server makes it (with the pixel hash) also runs through another tree's png.py, the two
alternated image by image, so that a change to the decoder is compared on one host in one process.

    python bench/png_paths.py [--json out.json] [--old OTHER_TREE/engine/inputs/png.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve import IMAGE_KINDS, synthetic_image  # noqa: E402

from engine.inputs import png  # noqa: E402
from engine.inputs.image_cache import PixelDigest, new_hash  # noqa: E402


def _median_ms(decode, datas) -> float:
    times = []
    for data in datas:
        start = time.perf_counter()
        decode(data)
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)

def _load(path: str):
    spec = importlib.util.spec_from_file_location("png_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alternated(modules, datas, repeats: int = 6) -> list[float]:
    """Median ms of each module's decode_rgb8 with the pixel hash, the modules taking turns on every image."""
    times = [[] for _ in modules]
    for _ in range(repeats):
        for data in datas:
            for module, out in zip(modules, times):
                start = time.perf_counter()
                module.decode_rgb8(data, module.chunks(data), PixelDigest().update)
                out.append((time.perf_counter() - start) * 1e3)
                _settle(module)
    return [round(statistics.median(t), 2) for t in times]


def _settle(module) -> None:
    """Untimed: until the background work a decode leaves (the next output array faulted in, if the module has
    engine.inputs.prefault) is done, as it is between two uploads, so that it runs beside neither decoder."""
    outputs = getattr(module, "OUTPUTS", None)
    if outputs is not None:
        outputs.wait()


PATHS = {"isal bands": (0, float("inf")), "libdeflate whole": (0, 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--images", type=int, default=6, help="fresh images per kind")
    ap.add_argument("--old", help="another tree's engine/inputs/png.py, timed against this one's")
    args = ap.parse_args()
    old = _load(args.old) if args.old else None
    rows = []
    for kind in IMAGE_KINDS:
        datas = []
        for seed in range(args.images):
            buf = io.BytesIO()
            synthetic_image(1024, seed, kind).save(buf, format="PNG")
            datas.append(buf.getvalue())
        row = {"kind": kind, "ratio": round(1024 * 3073 / len(datas[0]), 2), "chosen": None}
        for name, bands in [*PATHS.items(), ("libspng alone", None)]:
            times = []
            for data in datas:
                parts = png.chunks(data)
                start = time.perf_counter()
                if bands is None:
                    png.pyspng.load(data, format="RGB")
                else:
                    saved, png.BANDS_RATIO = png.BANDS_RATIO, bands
                    try:
                        png.decode_rgb8(data, parts)
                    finally:
                        png.BANDS_RATIO = saved
                times.append((time.perf_counter() - start) * 1e3)
            row[name] = round(statistics.median(times), 2)
        row["chosen"] = _median_ms(lambda data: png.decode_rgb8(data, png.chunks(data)), datas)
        # as the server decodes: hashing the pixels band by band (PixelDigest, one thread), and for comparison
        # with blake3's thread pool woken for every band
        row["chosen + pixel hash"] = _median_ms(
            lambda data: png.decode_rgb8(data, png.chunks(data), PixelDigest().update), datas)
        row["chosen + pixel hash (blake3 AUTO threads)"] = _median_ms(
            lambda data: png.decode_rgb8(data, png.chunks(data), new_hash().update), datas)
        if old is not None:
            row["old vs this, + pixel hash"] = _alternated([old, png], datas)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
