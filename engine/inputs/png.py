"""Fast decoding of plain 8-bit RGB PNGs: ISA-L inflates, libspng unfilters.

A 1024x1024 photo as PNG is ~1.7 MB of deflate that inflates to 3 MB of filtered scanlines. libspng spends
nearly all of its decode time in zlib's inflate (~12 of 12.9 ms here; ~21 ms in all on the H200's host), and
ISA-L's inflate (python-isal) does the same work 3x faster. libspng offers no way to hand it inflated data, so
the scanlines go back in as *stored* deflate blocks (a copy plus block headers): its inflate then only copies,
and its filter code and output stay the ones every other PNG goes through.

The inflate goes band by band (BAND_ROWS rows), and a worker thread unfilters each band while the next one
inflates: 1024x1024 photo 6.3 -> 4.8 ms here. ISA-L releases the GIL while it inflates; pyspng does not while
libspng decodes (~0.35 ms a band), so the two overlap but two unfilters never would. The worker also hands each
finished band to the caller's on_rows (the image processor hashes the pixels there, off the critical path); the
last band, which nothing overlaps, is kept short (TAIL_ROWS).

Near-incompressible data (noise, ratio under 1.15) and data compressed past 6:1 (screenshots, diagrams: long
matches) inflate fastest in libdeflate, in one call that cannot stop part way; libspng then unfilters the bands
one after another.

The output array comes from engine.inputs.prefault, mapped beforehand when an image of the same size came
before.

Checks: the zlib stream's Adler-32 (by ISA-L) and the inflated size, which must be exactly what IHDR implies;
inflating stops one byte past it, so a stream that claims more (a decompression bomb) costs no more than the
image. Chunk CRCs are not checked, as neither pyspng nor Pillow checks them for image data; a CRC call per
IDAT chunk would also re-take the GIL ~25 times, up to 5 ms each while another server thread holds it.
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.inputs.prefault import OUTPUTS

try:
    from isal import igzip_lib, isal_zlib
except ImportError:  # pragma: no cover - declared dependency; without it libspng does all the work
    igzip_lib = isal_zlib = None
try:   # libdeflate
    import deflate as libdeflate
except ImportError:  # pragma: no cover
    libdeflate = None
try:   # libspng; without it every PNG goes through Pillow (engine.inputs.image_io)
    import pyspng
except ImportError:  # pragma: no cover
    pyspng = None

SIGNATURE = b"\x89PNG\r\n\x1a\n"
STORED_BLOCK = 65535              # the largest stored deflate block
# Inflated / compressed size for which ISA-L band by band wins; outside it libdeflate whole wins (or libspng
# alone, without libdeflate). 1024x1024, local host: photo-like (1.2-7:1) ISA-L 3.0-5.8 ms, libdeflate 4.1-6.1;
# noise (1.0-1.1:1) 7.4 against 5.9 ms; a screenshot (34:1) 0.9 against 0.4 (libspng's zlib: 2.4).
BANDS_RATIO = (1.15, 6.0)
BAND_ROWS = 128                   # rows inflated, then unfiltered, at a time
TAIL_ROWS = 32                    # the last band, unfiltered after the inflate ends: kept short
# The banded decode's one worker: it unfilters a band while the caller inflates the next.
_WORKERS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="png-unfilter")
_IEND = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", 0xAE426082)


def chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, offset of its data, length) of each chunk, by hopping from header to header (an eXIf chunk may
    follow the image data; scanning every byte for it took 1.5 ms for a 3 MB file)."""
    out, pos = [], len(SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        out.append((kind, pos + 8, length))
        if kind == b"IEND":
            break
        pos += 12 + length
    return out


RowsCallback = Callable[[np.ndarray], None]


def decode_rgb8(data: bytes, parts: list[tuple[bytes, int, int]], on_rows: RowsCallback | None = None) -> np.ndarray:
    """uint8 [H, W, 3] of a non-interlaced 8-bit RGB PNG whose chunks are `parts` (from chunks(data)); the
    caller has checked the header (depth, colour type) and the pixel count. Raises ValueError if the data is
    corrupt or truncated. on_rows, if given, is called with the decoded rows top to bottom, band by band as
    they are ready (possibly on a worker thread), so that work on the pixels (a hash) overlaps the decode."""
    width, height = struct.unpack_from(">II", data, 16)
    expected = height * (1 + 3 * width)          # a filter-type byte, then the row's RGB bytes, per row
    ratio = expected / max(1, sum(length for kind, _, length in parts if kind == b"IDAT"))
    if isal_zlib is None or data[28] != 0:       # Adam7: scanline sizes vary by pass, libspng's own path
        out = pyspng.load(data, format="RGB")
    elif libdeflate is not None and not BANDS_RATIO[0] <= ratio < BANDS_RATIO[1]:
        return _refilled(_decode_whole(data, parts, width, height, on_rows))
    elif ratio >= BANDS_RATIO[1]:
        out = pyspng.load(data, format="RGB")
    else:
        return _refilled(_decode_in_bands(data, parts, width, height, on_rows))
    if on_rows is not None:
        on_rows(out)
    return out


def _refilled(out: np.ndarray) -> np.ndarray:
    """`out`, once an array of its shape is being faulted in for the next image of this size."""
    OUTPUTS.refill(out.shape)
    return out


def _decode_whole(data: bytes, parts, width: int, height: int, on_rows: RowsCallback | None) -> np.ndarray:
    """libdeflate inflates all the image data in one call (the fastest inflate for near-incompressible data and
    for long matches, but it cannot stop part way); libspng then unfilters it band by band."""
    view = memoryview(data)
    idat = b"".join(view[start:start + length] for kind, start, length in parts if kind == b"IDAT")
    expected = height * (1 + 3 * width)
    try:        # room for one byte more than the image needs, so that a stream claiming more is caught
        scanlines = libdeflate.zlib_decompress(idat, expected + 1)
    except libdeflate.DeflateError as e:
        raise ValueError(f"PNG image data is corrupt, or inflates to more than the {expected} bytes a {width}x"
                         f"{height} RGB image needs ({e})") from e
    if len(scanlines) != expected:
        raise ValueError(f"PNG image data inflates to {len(scanlines)}{'+' if len(scanlines) > expected else ''} "
                         f"bytes; a {width}x{height} RGB image needs {expected}")
    out = OUTPUTS.take((height, width, 3))
    row_bytes, view = 1 + 3 * width, memoryview(scanlines)
    # On this thread, band after band: libspng holds the GIL while it decodes, so threads would take turns
    # (1024x1024 noise, local host: 5 runs on 4 threads 2.6 ms, one after another 2.4). Bands rather than one
    # stored PNG of it all: one 3 MB PNG and its 3 MB copies inside libspng cost 5.4 ms, mostly page faults.
    edges = list(range(0, height, BAND_ROWS)) + [height]
    for top, bottom in zip(edges, edges[1:]):
        _unfilter_band(out, top, bottom, view[top * row_bytes:bottom * row_bytes], on_rows)
    return out


def band_edges(height: int) -> list[int]:
    """Row boundaries of the bands: BAND_ROWS each, then (when there are several) a last one of TAIL_ROWS,
    which nothing overlaps."""
    edges = list(range(0, height, BAND_ROWS)) + [height]
    if len(edges) > 2 and edges[-1] - edges[-2] > TAIL_ROWS:
        edges.insert(-1, height - TAIL_ROWS)
    return edges


def _decode_in_bands(data: bytes, parts, width: int, height: int, on_rows: RowsCallback | None) -> np.ndarray:
    """Inflate band after band of BAND_ROWS rows on this thread while a worker unfilters the band before: the
    unfiltering (and its re-wrap) hides behind the inflate, all but the last band's. Each band is its own
    stored PNG whose first row is the previous band's last decoded row, filter None: the band's Up, Average
    and Paeth rows then read the right row above."""
    view = memoryview(data)
    idat = b"".join(view[start:start + length] for kind, start, length in parts if kind == b"IDAT")
    # IgzipDecompressor allocates max_length at once and releases the GIL once per call: zlib-style
    # decompressobj grows its buffer step by step, re-taking the GIL each time, which behind a busy thread cost
    # 45 ms instead of 4.
    inflater = igzip_lib.IgzipDecompressor(flag=igzip_lib.DECOMP_ZLIB, hist_bits=15)
    row_bytes, out = 1 + 3 * width, OUTPUTS.take((height, width, 3))
    unfiltering = None
    edges = band_edges(height)
    for top, bottom in zip(edges, edges[1:]):
        want = (bottom - top) * row_bytes
        try:
            band = inflater.decompress(idat if top == 0 else b"", want)
        except igzip_lib.IsalError as e:
            raise ValueError(f"PNG image data is corrupt ({e})") from e
        if len(band) != want:
            raise ValueError(f"PNG image data inflates to {top * row_bytes + len(band)} bytes (stream ended "
                             f"early); a {width}x{height} RGB image needs {height * row_bytes}")
        if unfiltering is not None:
            unfiltering.result()                   # the band above is in `out`: its last row seeds this band
        if bottom < height:
            unfiltering = _WORKERS.submit(_unfilter_band, out, top, bottom, band, on_rows)
        else:                                      # the last band: nothing left to overlap with
            _unfilter_band(out, top, bottom, band, on_rows)
    if not inflater.eof:
        more = len(inflater.decompress(b"", 1))
        raise ValueError(f"PNG image data inflates to {height * row_bytes}{'+' if more else ''} bytes"
                         f"{'' if more else ' (stream not ended)'}; a {width}x{height} RGB image needs "
                         f"{height * row_bytes}")
    return out


def _unfilter_band(out: np.ndarray, top: int, bottom: int, band: bytes, on_rows: RowsCallback | None) -> None:
    width = out.shape[1]
    if top == 0:
        out[:bottom] = pyspng.load(_stored_png(width, bottom, band), format="RGB")
    else:
        seeded = b"".join((b"\x00", out[top - 1].tobytes(), band))
        out[top:bottom] = pyspng.load(_stored_png(width, bottom - top + 1, seeded), format="RGB")[1:]
    if on_rows is not None:
        on_rows(out[top:bottom])


def _stored_png(width: int, height: int, scanlines) -> bytes:
    """An 8-bit RGB PNG of width x height whose one IDAT holds `scanlines` as a zlib stream of stored blocks.
    One checksum call each over whole buffers: a call per block would re-take the GIL ~50 times, and a busy
    server thread holds it for up to 5 ms each time."""
    view = memoryview(scanlines)
    n = len(view)
    parts = [b"\x78\x01"]                         # zlib header: deflate, 32K window, no dictionary
    for at in range(0, max(n, 1), STORED_BLOCK):
        size = min(STORED_BLOCK, n - at)
        parts += [struct.pack("<BHH", at + size >= n, size, size ^ 0xFFFF), view[at:at + size]]  # BFINAL, BTYPE 00
    parts.append(struct.pack(">I", isal_zlib.adler32(view)))
    stream = b"".join(parts)
    crc = isal_zlib.crc32(stream, isal_zlib.crc32(b"IDAT"))
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join([SIGNATURE, struct.pack(">I", 13), ihdr, struct.pack(">I", isal_zlib.crc32(ihdr)),
                     struct.pack(">I", len(stream)), b"IDAT", stream, struct.pack(">I", crc), _IEND])
