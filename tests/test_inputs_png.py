"""The fast PNG path (ISA-L inflate, libspng unfilter) gives Pillow's pixels for every scanline filter and chunk
layout, and refuses corrupt, truncated or over-long image data as clearly as libspng did."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from engine.errors import ImageError
from engine.inputs import png
from engine.inputs.image_io import decode_image


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def handmade_png(width: int, height: int, seed: int = 0, idat_pieces: int = 1, scanlines: bytes | None = None,
                 interlace: int = 0) -> bytes:
    """An 8-bit RGB PNG whose rows use every filter type (None, Sub, Up, Average, Paeth) at random: any bytes
    after a filter byte are a valid filtered row, so Pillow's decode of it is the reference."""
    if scanlines is None:
        rng = np.random.default_rng(seed)
        rows = rng.integers(0, 256, (height, 1 + 3 * width), dtype=np.uint8)
        rows[:, 0] = rng.integers(0, 5, height)
        scanlines = rows.tobytes()
    z = zlib.compress(scanlines, 6)
    cut = [len(z) * i // idat_pieces for i in range(idat_pieces + 1)]
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    return (png.SIGNATURE + chunk(b"IHDR", ihdr) + b"".join(chunk(b"IDAT", z[a:b]) for a, b in zip(cut, cut[1:]))
            + chunk(b"IEND", b""))


def pillow(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("width, height, pieces", [(1, 1, 1), (37, 23, 1), (300, 250, 5), (1024, 70, 3)])
def test_every_filter_type_decodes_to_pillows_pixels(width, height, pieces):
    data = handmade_png(width, height, seed=width, idat_pieces=pieces)
    out = decode_image(data)
    assert isinstance(out, np.ndarray) and out.shape == (height, width, 3)
    np.testing.assert_array_equal(out, pillow(data))


@pytest.mark.parametrize("band_rows", [1, 16, 64])
def test_bands_seeded_by_the_row_above_decode_every_filter_across_their_edges(monkeypatch, band_rows):
    # 70 rows of random filters in bands of 1, 16, 64 rows: every band's first row reads the previous band's last
    monkeypatch.setattr(png, "BAND_ROWS", band_rows)
    data = handmade_png(33, 70, seed=band_rows, idat_pieces=4)
    np.testing.assert_array_equal(decode_image(data), pillow(data))


def test_images_larger_than_one_stored_block_round_trip():
    # 3 MB of scanlines: 49 stored blocks of at most 65535 bytes when handed to libspng
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    np.testing.assert_array_equal(decode_image(buf.getvalue()), np.asarray(image))


def test_the_fast_inflate_runs_and_libspng_only_unfilters(monkeypatch):
    seen = []
    real = png.pyspng.load
    monkeypatch.setattr(png.pyspng, "load", lambda data, **kw: seen.append(data) or real(data, **kw))
    data = handmade_png(64, 64)
    decode_image(data)
    [handed] = seen
    idat = [(s, n) for kind, s, n in png.chunks(handed) if kind == b"IDAT"]
    assert handed != data and len(idat) == 1
    assert handed[idat[0][0] + 2] & 0b110 == 0      # first deflate block is stored (BTYPE 00)


def test_highly_compressed_image_data_goes_to_libspng_whole(monkeypatch):
    # a screenshot-like image (long runs): zlib inflates it fast, the re-wrap would only add copies
    seen = []
    real = png.pyspng.load
    monkeypatch.setattr(png.pyspng, "load", lambda data, **kw: seen.append(data) or real(data, **kw))
    rows = np.zeros((64, 1 + 3 * 64), np.uint8)
    rows[:, 1::7] = 255
    data = handmade_png(64, 64, scanlines=rows.tobytes())
    np.testing.assert_array_equal(decode_image(data), pillow(data))
    assert seen == [data]


def test_interlaced_pngs_go_to_libspng_whole():
    # Adam7 rows differ in size from pass to pass; a 1x1 image has one pass of one pixel (Pillow cannot write
    # interlaced PNGs, so it is made by hand)
    data = handmade_png(1, 1, scanlines=bytes([0, 200, 100, 50]), interlace=1)
    np.testing.assert_array_equal(decode_image(data), pillow(data))


def test_a_bad_adler32_is_an_image_error():
    data = bytearray(handmade_png(16, 16))
    _, start, length = next(c for c in png.chunks(bytes(data)) if c[0] == b"IDAT")
    data[start + length - 1] ^= 0xFF                 # the zlib stream's last byte: its Adler-32
    with pytest.raises(ImageError, match="checksum"):
        decode_image(bytes(data))


def test_the_png_handed_to_libspng_carries_valid_checksums(monkeypatch):
    # libspng (as pyspng sets it up) ignores them today; the stored PNG must not depend on that
    seen = []
    real = png.pyspng.load
    monkeypatch.setattr(png.pyspng, "load", lambda data, **kw: seen.append(data) or real(data, **kw))
    decode_image(handmade_png(40, 30))
    handed = seen[0]
    _, start, length = next(c for c in png.chunks(handed) if c[0] == b"IDAT")
    stream = handed[start:start + length]
    assert struct.unpack(">I", handed[start + length:start + length + 4])[0] == zlib.crc32(b"IDAT" + stream)
    assert zlib.decompress(stream) == zlib.decompress(b"".join(
        handmade_png(40, 30)[s:s + n] for kind, s, n in png.chunks(handmade_png(40, 30)) if kind == b"IDAT"))


@pytest.mark.parametrize("band_rows", [128, 4])
@pytest.mark.parametrize("rows, message", [(10, "inflates to"), (40, r"inflates to \d+\+ bytes")])
def test_image_data_of_the_wrong_size_is_an_image_error(monkeypatch, rows, message, band_rows):
    # IHDR says 20 rows; the stream holds 10 (truncated) or 40 (more than the image: inflating stops early),
    # decoded in one band or in bands of 4 rows. Random bytes (filter type 0): incompressible, so the fast path
    # takes them.
    monkeypatch.setattr(png, "BAND_ROWS", band_rows)
    scan = np.random.default_rng(rows).integers(0, 256, (rows, 1 + 3 * 8), dtype=np.uint8)
    scan[:, 0] = 0
    scan = scan.tobytes()
    good = handmade_png(8, 20, scanlines=scan)
    with pytest.raises(ImageError, match=message):
        decode_image(good)


def test_a_corrupt_deflate_stream_is_an_image_error():
    data = handmade_png(32, 32)
    _, start, length = next(c for c in png.chunks(data) if c[0] == b"IDAT")
    body = bytearray(data[start:start + length])
    body[2:10] = b"\xff" * 8
    bad = data[:start - 8] + chunk(b"IDAT", bytes(body)) + data[start + length + 4:]
    with pytest.raises(ImageError, match="could not decode image"):
        decode_image(bad)
