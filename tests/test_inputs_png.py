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


@pytest.fixture(params=["bands", "whole"])
def inflate(request, monkeypatch) -> str:
    """Run the test through each fast path, whatever the data's compression ratio: ISA-L band by band, or
    libdeflate whole and then unfiltered band by band (bands of a few rows here, so that images cross many)."""
    monkeypatch.setattr(png, "BANDS_RATIO", (0, float("inf")) if request.param == "bands" else (0, 0))
    monkeypatch.setattr(png, "BAND_ROWS", 3)
    return request.param


def spy_on_libspng(monkeypatch) -> list[bytes]:
    """The PNGs handed to libspng, from now on."""
    seen, real = [], png.pyspng.load
    monkeypatch.setattr(png.pyspng, "load", lambda data, **kw: seen.append(data) or real(data, **kw))
    return seen


def stored(handed: bytes) -> bool:
    """Whether a PNG's image data is one zlib stream whose first deflate block is stored (BTYPE 00)."""
    idat = [(s, n) for kind, s, n in png.chunks(handed) if kind == b"IDAT"]
    return len(idat) == 1 and handed[idat[0][0] + 2] & 0b110 == 0


@pytest.mark.parametrize("width, height, pieces", [(1, 1, 1), (37, 23, 1), (300, 250, 5), (1024, 70, 3)])
def test_every_filter_type_decodes_to_pillows_pixels(width, height, pieces, inflate):
    data = handmade_png(width, height, seed=width, idat_pieces=pieces)
    out = decode_image(data)
    assert isinstance(out, np.ndarray) and out.shape == (height, width, 3)
    np.testing.assert_array_equal(out, pillow(data))


@pytest.mark.parametrize("band_rows, tail_rows", [(1, 32), (16, 32), (64, 32), (32, 5), (64, 1)])
def test_bands_seeded_by_the_row_above_decode_every_filter_across_their_edges(monkeypatch, band_rows, tail_rows):
    # 70 rows of random filters in bands of 1 to 64 rows, the last band cut to tail_rows: every band's first row
    # reads the previous band's last
    monkeypatch.setattr(png, "BAND_ROWS", band_rows)
    monkeypatch.setattr(png, "TAIL_ROWS", tail_rows)
    data = handmade_png(33, 70, seed=band_rows, idat_pieces=4)
    np.testing.assert_array_equal(decode_image(data), pillow(data))


def test_bands_cover_the_rows_once_and_end_in_a_short_tail():
    assert png.band_edges(1024) == [0, 128, 256, 384, 512, 640, 768, 896, 992, 1024]
    assert png.band_edges(1000) == [0, 128, 256, 384, 512, 640, 768, 896, 968, 1000]
    assert png.band_edges(150) == [0, 128, 150]          # the last band is already short
    assert png.band_edges(100) == [0, 100]               # one band: nothing to overlap, so no tail


@pytest.mark.parametrize("width, height, pieces", [(1024, 300, 3), (40, 30, 1)])
def test_the_decoder_hands_over_every_row_once_in_order(width, height, pieces):
    # 300 rows: banded inflate, rows handed over from the worker threads; 40x30: one libspng call, all at once
    data = handmade_png(width, height, seed=3, idat_pieces=pieces)
    got = []
    out = decode_image(data, on_rows=lambda rows: got.append(rows.copy()))
    np.testing.assert_array_equal(np.concatenate(got), out)
    np.testing.assert_array_equal(out, pillow(data))


def test_the_pixel_digest_made_during_the_decode_is_the_hash_of_the_pixels():
    from engine.inputs.image_cache import PixelDigest, new_hash
    data = handmade_png(512, 400, seed=4, idat_pieces=2)
    during = PixelDigest()
    out = decode_image(data, on_rows=during.update)
    assert during.digest(out) == new_hash(out.data).digest() == PixelDigest().digest(out)
    # not fed (a cache hit, or another decoder): it hashes the pixels it is given
    assert PixelDigest().digest(out[:200]) == new_hash(np.ascontiguousarray(out[:200]).data).digest()


def test_images_larger_than_one_stored_block_round_trip():
    # 3 MB of scanlines: 49 stored blocks of at most 65535 bytes when handed to libspng
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    np.testing.assert_array_equal(decode_image(buf.getvalue()), np.asarray(image))


def test_the_fast_inflate_runs_and_libspng_only_unfilters(monkeypatch, inflate):
    seen = spy_on_libspng(monkeypatch)
    decode_image(handmade_png(64, 64))
    assert seen and all(stored(handed) for handed in seen)


def test_whole_inflates_unfilter_band_by_band_each_seeded_by_the_row_above(monkeypatch):
    monkeypatch.setattr(png, "BANDS_RATIO", (0, 0))       # libdeflate whole, whatever the ratio
    monkeypatch.setattr(png, "BAND_ROWS", 16)
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, (60, 1 + 3 * 20), dtype=np.uint8)
    rows[:, 0] = rng.choice([2, 3, 4], 60)            # Up, Average, Paeth only: every row reads the row above
    data = handmade_png(20, 60, scanlines=rows.tobytes())
    seen = spy_on_libspng(monkeypatch)
    got = []
    out = decode_image(data, on_rows=lambda band: got.append(len(band)))
    np.testing.assert_array_equal(out, pillow(data))
    # bands of 16 rows; each after the first carries the row above it, decoded, as its first row
    assert [struct.unpack_from(">I", handed, 20)[0] for handed in seen] == [16, 17, 17, 13]    # IHDR height
    assert got == [16, 16, 16, 12]


@pytest.mark.parametrize("have_libdeflate", [True, False])
def test_highly_compressed_image_data_is_inflated_whole(monkeypatch, have_libdeflate):
    # a screenshot-like image (long runs): libdeflate inflates it fastest; without it libspng's zlib does
    if not have_libdeflate:
        monkeypatch.setattr(png, "libdeflate", None)
    seen = spy_on_libspng(monkeypatch)
    rows = np.zeros((64, 1 + 3 * 64), np.uint8)
    rows[:, 1::7] = 255
    data = handmade_png(64, 64, scanlines=rows.tobytes())
    np.testing.assert_array_equal(decode_image(data), pillow(data))
    assert seen == ([png._stored_png(64, 64, rows.tobytes())] if have_libdeflate else [data])


def test_interlaced_pngs_go_to_libspng_whole():
    # Adam7 rows differ in size from pass to pass; a 1x1 image has one pass of one pixel (Pillow cannot write
    # interlaced PNGs, so it is made by hand)
    data = handmade_png(1, 1, scanlines=bytes([0, 200, 100, 50]), interlace=1)
    np.testing.assert_array_equal(decode_image(data), pillow(data))


def test_a_bad_adler32_is_an_image_error(inflate):
    data = bytearray(handmade_png(16, 16))
    _, start, length = next(c for c in png.chunks(bytes(data)) if c[0] == b"IDAT")
    data[start + length - 1] ^= 0xFF                 # the zlib stream's last byte: its Adler-32
    with pytest.raises(ImageError, match="checksum" if inflate == "bands" else "corrupt"):
        decode_image(bytes(data))


def test_the_pngs_handed_to_libspng_carry_valid_checksums(monkeypatch, inflate):
    # libspng (as pyspng sets it up) ignores them today; the stored PNGs must not depend on that
    seen = spy_on_libspng(monkeypatch)
    original = handmade_png(40, 30)
    decode_image(original)
    scanlines = b""
    for handed in seen:
        _, start, length = next(c for c in png.chunks(handed) if c[0] == b"IDAT")
        stream = handed[start:start + length]
        assert struct.unpack(">I", handed[start + length:start + length + 4])[0] == zlib.crc32(b"IDAT" + stream)
        # a band after the first carries the row above as its first row
        scanlines += zlib.decompress(stream)[(1 + 3 * 40) if scanlines else 0:]
    assert scanlines == zlib.decompress(b"".join(original[s:s + n] for kind, s, n in png.chunks(original)
                                                 if kind == b"IDAT"))


@pytest.mark.parametrize("band_rows", [128, 4])
@pytest.mark.parametrize("rows, message", [(10, "inflates to"), (40, r"inflates to (\d+\+ bytes|more than)")])
def test_image_data_of_the_wrong_size_is_an_image_error(monkeypatch, rows, message, band_rows, inflate):
    # IHDR says 20 rows; the stream holds 10 (truncated) or 40 (more than the image: inflating stops early),
    # decoded whole, in one band or in bands of 4 rows. Random bytes (filter type 0).
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


def test_images_of_one_size_decode_into_memory_of_their_own(inflate):
    """The decoder takes its output from a pool refilled after each decode (engine/inputs/prefault.py): the
    second image of a size must not land in the first one's array, which the caller still holds."""
    datas = [handmade_png(64, 40, seed) for seed in range(3)]
    outs = []
    for data in datas:
        outs.append(png.decode_rgb8(data, png.chunks(data)))
        png.OUTPUTS.wait()
    for data, out in zip(datas, outs):
        assert np.array_equal(out, pillow(data))
