"""Image bytes in, RGB pixels out (a PIL image or a uint8 array), without trusting the sender; and the one
resolver of media URLs (data:, http(s), file://) for images and videos alike (`fetch_media_bytes`).

Every limit is checked before the work it protects: the byte size before base64-decoding or reading, the pixel
count from the header before the full decode (a 50 KB PNG can claim 100k x 100k pixels). Only base64 data URLs
are accepted by default; http(s) URLs need `allow_remote` (the server's --allow-remote-media) and file:// URLs need
`allowed_local_media_path` (the server's --allowed-local-media-path, vLLM's name), because a server that fetches
URLs for its callers can be pointed at the private network or at its own disk.
"""
from __future__ import annotations

import binascii
import io
import struct
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pybase64
import pyspng
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.errors import ImageError, InvalidInputError, PayloadTooLargeError, ServerBusyError

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_FETCH_TIMEOUT_S = 10.0
# The formats browsers and cameras produce; Pillow's rarer decoders stay out of reach of request bodies.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phone photos)
_MAX_CHUNKS_WALKED = 4096                 # PNG encoders write IDAT chunks of 8 KB and more


def split_data_url(url: str, media: str = "image", param: str | None = None) -> tuple[str, str]:
    """(media type, base64 payload) of a `data:<media>/<format>;base64,<data>` URL: `media` is the kind the
    field takes (image, video)."""
    comma = url.find(",", 0, 256)     # the header is short; the payload may be megabytes: slice it once
    if not url.startswith("data:") or comma < 0:
        raise InvalidInputError(f"expected a {media} data URL: data:{media}/<format>;base64,<data>", param=param)
    header, payload = url[:comma], url[comma + 1:]
    media_type, *params = header[len("data:"):].split(";")
    if not media_type.lower().startswith(f"{media}/"):
        examples = "image/png, image/jpeg, image/webp" if media == "image" else "video/mp4, video/webm"
        raise InvalidInputError(f"data URL has media type {media_type or '(none)'!r}; expected {examples}...",
                                param=param)
    if "base64" not in (p.strip().lower() for p in params):
        raise InvalidInputError(f"{media} data URLs must be base64-encoded: data:{media}/<format>;base64,<data>",
                                param=param)
    return media_type.lower(), payload


def b64decode(payload: str, max_bytes: int, param: str | None = None, media: str = "image") -> bytes:
    """Base64 -> bytes, refused (413) before decoding when it would be over max_bytes."""
    if len(payload) // 4 * 3 > max_bytes + 3:  # refuse before decoding: base64 is 4 chars per 3 bytes
        raise PayloadTooLargeError(f"{media} is about {len(payload) // 4 * 3} bytes, over the limit of {max_bytes} "
                                   f"bytes", param=param)
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        # Some clients wrap base64 at 76 columns: strip only when needed.
        stripped = "".join(payload.split())
        if len(stripped) != len(payload):
            try:
                return pybase64.b64decode(stripped, validate=True)
            except (binascii.Error, ValueError) as e2:
                e = e2
        raise ImageError(f"{media} data URL is not valid base64: {e}", param=param) from e


def decode_data_url(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, param: str | None = None,
                    media: str = "image") -> bytes:
    """The bytes of a `data:<media>/<format>;base64,<data>` URL."""
    return b64decode(split_data_url(url, media, param)[1], max_bytes, param, media)


def fetch_media_bytes(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, allow_remote: bool = False,
                      allowed_local_media_path: str | Path | None = None, timeout: float = DEFAULT_FETCH_TIMEOUT_S,
                      param: str | None = None, media: str = "image") -> bytes:
    """The bytes behind an image or video URL (`media`): data: always; http(s) only with allow_remote; file://
    only inside allowed_local_media_path."""
    # Before urlsplit, which scans (and caches) the whole multi-MB string.
    if url[:5].lower() == "data:":
        return decode_data_url(url, max_bytes, param, media)
    _refuse_control_characters(url, f"{media} URL", param)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        if not allow_remote:
            raise InvalidInputError(f"{media} URLs over http(s) are disabled on this server; send the {media} as a "
                                    f"data:{media}/...;base64 URL, or start the server with --allow-remote-media",
                                    param=param)
        return _fetch_http(url, max_bytes, timeout, param, media)
    if scheme == "file":
        if allowed_local_media_path is None:
            raise InvalidInputError(f"file:// {media} URLs are disabled on this server; send the {media} as a "
                                    f"data:{media}/...;base64 URL, or start the server with "
                                    f"--allowed-local-media-path DIR", param=param)
        return _read_local(url, Path(allowed_local_media_path), max_bytes, param, media)
    raise InvalidInputError(f"unsupported {media} URL scheme {scheme or '(none)'!r}; send a data:{media}/...;base64 "
                            f"URL", param=param)


fetch_image_bytes = fetch_media_bytes


def decode_image(data: bytes, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 param: str | None = None, on_size: Callable[[int, int], None] | None = None
                 ) -> Image.Image | np.ndarray:
    """Decode image bytes into an RGB image, upright as its EXIF orientation says (as browsers show photos); an
    8-bit RGB PNG comes back as libspng decoded it, uint8 [H, W, 3]: the image processor takes the array as it is,
    where a PIL image would cost two copies of the pixels. on_size(width, height) runs once the header is read
    and checked, before any pixel is decoded."""
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"image is {len(data)} bytes, over the limit of {max_bytes} bytes", param=param)
    try:
        with warnings.catch_warnings():
            # Our own max_pixels check below is the guard; Pillow's bomb warning would only be noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)  # lazy: reads the header only
            check_pixels(image.width, image.height, max_pixels, param)
            if on_size is not None:
                on_size(image.width, image.height)
            pixels = _spng_pixels(data, image)
            if pixels is not None:
                return pixels if image.mode == "RGB" else to_rgb(Image.fromarray(pixels))
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
    except (ImageError, PayloadTooLargeError, ServerBusyError):
        raise
    except Image.DecompressionBombError as e:  # Pillow's own hard stop (2 x 89 Mpx) fires while reading the header
        raise ImageError(f"image has more than the limit of {max_pixels} pixels: {e}", param=param) from e
    except UnidentifiedImageError as e:
        raise ImageError(f"could not decode image: not a {', '.join(ALLOWED_FORMATS)} image", param=param) from e
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError... for corrupt files
        raise ImageError(f"could not decode image: {e}", param=param) from e
    return to_rgb(image)


def image_size(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, param: str | None = None
               ) -> tuple[int, int]:
    """(width, height) from the image's header alone, checked against max_pixels: what a request's images will
    cost is known before any of them is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as image:   # lazy: reads the header only
                width, height = image.size
    except Image.DecompressionBombError as e:
        raise ImageError(f"image has more than the limit of {max_pixels} pixels: {e}", param=param) from e
    except UnidentifiedImageError as e:
        raise ImageError(f"could not decode image: not a {', '.join(ALLOWED_FORMATS)} image", param=param) from e
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError... for corrupt headers
        raise ImageError(f"could not decode image: {e}", param=param) from e
    check_pixels(width, height, max_pixels, param)
    return width, height


def _spng_pixels(data: bytes, header: Image.Image) -> np.ndarray | None:
    """The pixels of an 8-bit RGB or RGBA PNG, decoded by libspng (faster than Pillow here: docs/perf-log.md):
    the same values Pillow gives, since PNG is lossless. None for every other image, which Pillow decodes:
    palettes, grey, 16 bits, a tRNS colour key, an eXIf orientation, or bytes libspng refuses (Pillow then says
    what is wrong with them). pyspng keeps the GIL while libspng decodes (Pillow releases it): the process's
    other threads, the engine loop among them, wait that long."""
    if (header.format != "PNG" or header.mode not in ("RGB", "RGBA") or header.tile[0].args != header.mode
            or "transparency" in header.info or _has_exif(data, header)):
        return None
    try:
        pixels = pyspng.load(data, format=header.mode)
    except Exception:  # noqa: BLE001 - libspng's errors are plain RuntimeErrors without a kind
        return None
    return pixels if pixels.shape == (header.height, header.width, len(header.mode)) else None


def _has_exif(data: bytes, header: Image.Image) -> bool:
    """Whether the PNG has an eXIf chunk: before the image data Pillow's header parse has read it; after it, the
    chunk headers from the first IDAT on tell, without a search through megabytes of compressed pixels (unless
    the file cuts its data into a great many chunks)."""
    if "exif" in header.info:
        return True
    pos = header.tile[0].offset - 8        # the first IDAT chunk's length field
    for _ in range(_MAX_CHUNKS_WALKED):
        if pos + 8 > len(data):
            return False
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind in (b"eXIf", b"IEND"):
            return kind == b"eXIf"
        pos += length + 12                 # length, type, data, CRC
    return data.find(b"eXIf", pos) >= 0


def check_pixels(width: int, height: int, max_pixels: int, param: str | None = None) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"image is {width}x{height}: it has no pixels", param=param)
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}; "
                         f"downscale it before sending", param=param)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white: what transformers' convert_to_rgb does, so the
    image processor sees the same pixels as the reference."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# ---- remote and local sources (both opt-in) ---------------------------------------------------------------------
class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s): a redirect must not turn a remote fetch into ftp:// or file://."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.URLError(f"refusing redirect to {newurl!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects())


def _fetch_http(url: str, max_bytes: int, timeout: float, param: str | None, media: str) -> bytes:
    try:
        with _OPENER.open(urllib.request.Request(url, headers={"User-Agent": "localchat-engine"}),
                          timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise PayloadTooLargeError(f"{media} at {url} is {length} bytes, over the limit of {max_bytes} "
                                           f"bytes", param=param)
            data = resp.read(max_bytes + 1)  # never more than the cap, whatever the header said
    except PayloadTooLargeError:
        raise
    except Exception as e:  # noqa: BLE001 - URLError, HTTPError, timeouts, connection resets
        raise ImageError(f"could not fetch {media} {url}: {e}", param=param) from e
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"{media} at {url} is over the limit of {max_bytes} bytes", param=param)
    return data


def _refuse_control_characters(text: str, what: str, param: str | None) -> None:
    """400 for a NUL or another control character (C0, DEL): no URL or path holds one, and the file system
    would fail on a NUL with a ValueError."""
    bad = next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise InvalidInputError(f"the {what} holds a control character (\\u{ord(bad):04x}) at character "
                                f"{text.index(bad)}; remove it", param=param)


def _read_local(url: str, allowed_dir: Path, max_bytes: int, param: str | None, media: str) -> bytes:
    """The file a file:// URL names, inside allowed_dir. Errors name the path as the URL gave it, never where
    a symlink leads nor the allowed directory: the client learns nothing of the disk it did not send."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidInputError(f"file:// URL must name a local path, got host {parts.netloc!r}", param=param)
    given = urllib.request.url2pathname(parts.path)
    _refuse_control_characters(given, "file path", param)
    shown = repr(given[:200])
    # resolve() follows symlinks and '..', so the containment check sees where the file really is.
    path = Path(given).resolve()
    root = allowed_dir.expanduser().resolve()
    if not path.is_relative_to(root):
        raise InvalidInputError(f"{shown} is outside the allowed local media directory (--allowed-local-media-path)",
                                param=param)
    if not path.is_file():
        raise ImageError(f"no such {media} file: {shown}", param=param)
    size = path.stat().st_size
    if size > max_bytes:
        raise PayloadTooLargeError(f"{media} {shown} is {size} bytes, over the limit of {max_bytes} bytes",
                                   param=param)
    return path.read_bytes()
