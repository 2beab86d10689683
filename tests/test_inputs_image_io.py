"""Image bytes are decoded into RGB images safely: limits before work, clear errors, remote/local URLs opt-in."""
from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib

import numpy as np
import pytest
from PIL import Image

from engine.errors import ImageError, InvalidInputError, PayloadTooLargeError
from engine.inputs.image_io import decode_data_url, decode_image, fetch_image_bytes, to_rgb


def load_image(data: bytes, **limits) -> Image.Image:
    """decode_image's result as a PIL image (a PNG decodes to an RGB array), for the assertions."""
    image = decode_image(data, **limits)
    return Image.fromarray(image) if isinstance(image, np.ndarray) else image


def encode(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_args)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixel data is garbage: only a header-first check passes
    it to the pixel limit instead of failing (or exploding) in the decoder."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"garbage") + png_chunk(b"IEND", b"")


def png_rgb16(width: int, height: int, seed: int = 0) -> bytes:
    """A 16-bit RGB PNG (Pillow cannot write one): rows of random samples, filter type 0."""
    import numpy as np
    samples = np.random.default_rng(seed).integers(0, 1 << 16, (height, width * 3)).astype(">u2").tobytes()
    rows = b"".join(b"\0" + samples[y * width * 6:(y + 1) * width * 6] for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(rows))
            + png_chunk(b"IEND", b""))


RED = Image.new("RGB", (48, 32), (255, 0, 0))


# ---- data URLs ------------------------------------------------------------------------------------------------
def test_data_url_round_trips_the_bytes():
    data = encode(RED)
    assert decode_data_url(data_url(data)) == data


def test_data_url_tolerates_line_wrapped_base64():
    data = encode(RED)
    b64 = base64.encodebytes(data).decode()  # wrapped at 76 columns with newlines
    assert decode_data_url(f"data:image/png;base64,{b64}") == data


@pytest.mark.parametrize("url, error, message", [
    ("http://example.com/cat.png", InvalidInputError, "data:image/<format>;base64"),
    ("data:text/plain;base64,aGVsbG8=", InvalidInputError, "media type 'text/plain'"),
    ("data:image/png,rawbytes", InvalidInputError, "must be base64-encoded"),
    ("data:image/png;base64,not*valid*base64", ImageError, "not valid base64"),
])
def test_malformed_data_urls_are_refused_with_a_reason(url, error, message):
    with pytest.raises(error, match=message):
        decode_data_url(url)


def test_oversized_data_url_is_refused_before_decoding():
    url = "data:image/png;base64," + "A" * 4000  # 3000 bytes once decoded
    with pytest.raises(PayloadTooLargeError, match="over the limit of 1000 bytes") as info:
        decode_data_url(url, max_bytes=1000, param="messages[0].content[0].image_url")
    assert info.value.status == 413 and info.value.param == "messages[0].content[0].image_url"


# ---- decoding -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_common_formats_decode_to_rgb(fmt):
    image = load_image(encode(RED, fmt))
    assert image.mode == "RGB" and image.size == (48, 32)
    assert image.getpixel((5, 5))[0] > 200


@pytest.mark.parametrize("mode, pixel, expected", [
    ("RGBA", (255, 0, 0, 0), (255, 255, 255)),       # fully transparent -> the white background
    ("RGBA", (255, 0, 0, 255), (255, 0, 0)),         # opaque stays
    ("LA", (0, 0), (255, 255, 255)),
    ("L", 77, (77, 77, 77)),
])
def test_modes_convert_to_rgb_with_alpha_on_white(mode, pixel, expected):
    image = load_image(encode(Image.new(mode, (8, 8), pixel)))
    assert image.mode == "RGB" and image.getpixel((0, 0)) == expected


def test_palette_with_transparency_composites_on_white():
    image = Image.new("P", (8, 8), 0)
    image.putpalette([10, 20, 30] * 256)
    assert load_image(encode(image, transparency=0)).getpixel((0, 0)) == (255, 255, 255)


def test_cmyk_jpeg_converts_to_rgb():
    image = load_image(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"))
    r, g, b = image.getpixel((4, 4))
    assert image.mode == "RGB" and r > 200 and g < 60 and b < 60


def test_to_rgb_matches_transformers_convert_to_rgb():
    from transformers.image_transforms import convert_to_rgb
    rgba = Image.new("RGBA", (4, 4), (200, 100, 50, 128))
    assert to_rgb(rgba).tobytes() == convert_to_rgb(rgba, return_numpy=True).tobytes()


def test_exif_orientation_is_applied_as_browsers_show_photos():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    image = load_image(encode(Image.new("RGB", (60, 20)), "JPEG", exif=exif.tobytes()))
    assert image.size == (20, 60)


def test_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 0, 255)]]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert load_image(data).getpixel((0, 0))[0] > 200


def test_bytes_over_the_limit_are_refused_before_decoding():
    with pytest.raises(PayloadTooLargeError, match="is 2000 bytes, over the limit of 1000"):
        load_image(b"\0" * 2000, max_bytes=1000)   # garbage: a decode attempt would say "could not decode"


def test_pixel_count_is_checked_from_the_header_before_decoding():
    with pytest.raises(ImageError, match="image is 8000x6000 = 48000000 pixels, over the limit of 40000000"):
        load_image(png_header_only(8000, 6000))


def test_decompression_bomb_past_pillows_own_limit_is_an_image_error():
    with pytest.raises(ImageError, match="pixels"):
        load_image(png_header_only(100_000, 100_000))


def test_pixel_limit_is_configurable():
    with pytest.raises(ImageError, match="48x32 = 1536 pixels, over the limit of 1000"):
        load_image(encode(RED), max_pixels=1000)


@pytest.mark.parametrize("data, message", [
    (b"definitely not an image", "could not decode image"),
    (encode(RED)[:60], "could not decode image"),             # truncated PNG
    (encode(RED, "PPM"), "could not decode image: not a PNG"),  # a format request bodies may not use
])
def test_undecodable_bytes_are_an_image_error(data, message):
    with pytest.raises(ImageError, match=message):
        load_image(data)


ROTATE_90 = Image.Exif()
ROTATE_90[0x0112] = 6   # Orientation: rotate 90 degrees clockwise to display


def noise_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    import numpy as np
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("where", ["before the image data", "after the image data"])
def test_an_exif_chunk_before_or_after_the_image_data_is_seen(where):
    exif = ROTATE_90.tobytes()
    if where == "before the image data":
        data = encode(noise_rgb(20, 10), exif=exif)   # Pillow writes eXIf before IDAT
    else:
        data = encode(noise_rgb(20, 10))
        data = data[:-12] + png_chunk(b"eXIf", exif) + data[-12:]   # just before IEND
    assert load_image(data).size == (10, 20)          # rotated, as the EXIF orientation says
    assert decode_image(data).size == (10, 20)        # by Pillow: libspng does not read EXIF


def test_an_exif_chunk_after_thousands_of_small_data_chunks_is_seen():
    data = encode(noise_rgb(64, 32))
    stream = data[41:41 + struct.unpack(">I", data[33:37])[0]]      # the one IDAT's payload, after the IHDR
    assert len(stream) > 4096                                       # more one-byte chunks than are walked
    tiny = b"".join(png_chunk(b"IDAT", stream[i:i + 1]) for i in range(len(stream)))
    data = data[:33] + tiny + png_chunk(b"eXIf", ROTATE_90.tobytes()) + png_chunk(b"IEND", b"")
    assert load_image(data).size == (32, 64)


@pytest.mark.parametrize("image, save_args", [
    (noise_rgb(20, 10), {}),
    (noise_rgb(20, 10).convert("RGBA"), {}),                     # alpha: composited on white
    (noise_rgb(20, 10), {"transparency": (0, 0, 0)}),            # tRNS colour key
    (noise_rgb(20, 10).convert("L"), {}),
])
def test_pngs_decode_to_the_rgb_pixels_transformers_sees(image, save_args):
    from transformers.image_transforms import convert_to_rgb
    data = encode(image, **save_args)
    expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    out = load_image(data)
    assert out.mode == "RGB" and out.tobytes() == expected.tobytes()


@pytest.mark.parametrize("data, by_libspng", [
    (encode(noise_rgb(20, 10)), True), (encode(noise_rgb(20, 10).convert("RGBA")), True),
    (encode(noise_rgb(20, 10), transparency=(0, 0, 0)), False), (encode(noise_rgb(20, 10).convert("L")), False),
    (encode(noise_rgb(20, 10).convert("P")), False), (png_rgb16(20, 10), False),
    (encode(noise_rgb(20, 10), "BMP"), False),
], ids=["rgb", "rgba", "rgb-trns", "grey", "palette", "rgb-16-bit", "bmp"])
def test_8_bit_rgb_and_rgba_pngs_take_libspng_and_give_pillows_pixels(data, by_libspng, monkeypatch):
    import engine.inputs.image_io as image_io
    calls = []
    real_load = image_io.pyspng.load
    monkeypatch.setattr(image_io.pyspng, "load", lambda *a, **k: calls.append(1) or real_load(*a, **k))
    out = load_image(data)
    assert bool(calls) == by_libspng
    assert out.mode == "RGB" and out.tobytes() == to_rgb(Image.open(io.BytesIO(data))).tobytes()


def test_decode_image_gives_an_8_bit_rgb_png_as_libspngs_array_and_any_other_image_as_pil():
    import numpy as np
    image = noise_rgb(20, 10)
    pixels = decode_image(encode(image))
    assert isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.shape == (10, 20, 3)
    assert pixels.tobytes() == image.tobytes()
    for other in (encode(image.convert("RGBA")), encode(image, "JPEG")):
        assert isinstance(decode_image(other), Image.Image) and decode_image(other).mode == "RGB"


def test_corrupt_plain_rgb_png_is_an_image_error():
    data = encode(noise_rgb(64, 64))
    with pytest.raises(ImageError, match="could not decode image"):
        load_image(data[:len(data) // 2])


# ---- http(s) and file:// URLs ---------------------------------------------------------------------------------
class _Server(http.server.ThreadingHTTPServer):
    routes: dict[str, tuple[int, dict[str, str], bytes]]


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        status, headers, body = self.server.routes.get(self.path, (404, {}, b"not found"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server():
    server = _Server(("127.0.0.1", 0), _Handler)
    png = encode(RED)
    server.routes = {
        "/red.png": (200, {"Content-Length": str(len(png))}, png),
        "/big-declared.png": (200, {"Content-Length": str(10_000)}, b"\0" * 10_000),
        "/big-undeclared.png": (200, {}, b"\0" * 10_000),   # no Content-Length: the read itself is capped
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
    }
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    server.shutdown()


def test_http_urls_are_refused_by_default_naming_the_flag(http_server):
    base, _ = http_server
    with pytest.raises(InvalidInputError, match="--allow-remote-media"):
        fetch_image_bytes(f"{base}/red.png")


def test_http_urls_are_fetched_when_allowed(http_server):
    base, png = http_server
    assert fetch_image_bytes(f"{base}/red.png", allow_remote=True) == png


@pytest.mark.parametrize("path", ["/big-declared.png", "/big-undeclared.png"])
def test_http_fetch_obeys_the_byte_cap(http_server, path):
    base, _ = http_server
    with pytest.raises(PayloadTooLargeError, match="over the limit of 5000 bytes"):
        fetch_image_bytes(f"{base}{path}", max_bytes=5000, allow_remote=True)


@pytest.mark.parametrize("path", ["/missing.png", "/to-file"])
def test_http_failures_and_redirects_off_http_are_image_errors(http_server, path):
    base, _ = http_server
    with pytest.raises(ImageError, match="could not fetch"):
        fetch_image_bytes(f"{base}{path}", allow_remote=True)


def test_file_urls_are_refused_by_default_naming_the_flag(tmp_path):
    (tmp_path / "a.png").write_bytes(encode(RED))
    with pytest.raises(InvalidInputError, match="--allowed-local-media-path"):
        fetch_image_bytes((tmp_path / "a.png").as_uri())


def test_file_urls_inside_the_allowed_directory_are_read(tmp_path):
    (tmp_path / "a.png").write_bytes(encode(RED))
    assert fetch_image_bytes((tmp_path / "a.png").as_uri(), allowed_local_media_path=tmp_path) == encode(RED)


def test_file_urls_cannot_escape_the_allowed_directory(tmp_path):
    media, secret = tmp_path / "media", tmp_path / "secret.png"
    media.mkdir()
    secret.write_bytes(encode(RED))
    (media / "link.png").symlink_to(secret)
    for url in [secret.as_uri(), f"file://{media}/../secret.png", (media / "link.png").as_uri()]:
        with pytest.raises(InvalidInputError, match="outside the allowed local media directory"):
            fetch_image_bytes(url, allowed_local_media_path=media)


def test_file_url_errors_name_only_what_was_sent(tmp_path):
    """A symlink's target and the allowed directory are the server's business: errors quote the URL's path."""
    media, secret = tmp_path / "media", tmp_path / "hidden" / "secret.png"
    media.mkdir()
    secret.parent.mkdir()
    secret.write_bytes(encode(RED))
    (media / "link.png").symlink_to(secret)
    (media / "dangling.png").symlink_to(tmp_path / "hidden" / "gone.png")
    for name in ("link.png", "dangling.png"):
        with pytest.raises(InvalidInputError) as err:
            fetch_image_bytes((media / name).as_uri(), allowed_local_media_path=media)
        assert "hidden" not in err.value.message and name in err.value.message, err.value.message


@pytest.mark.parametrize("suffix", ["ok.png%00.txt", "ok.png%0a", "ok%7f.png"])
def test_control_characters_in_file_urls_are_400(tmp_path, suffix):
    (tmp_path / "ok.png").write_bytes(encode(RED))
    with pytest.raises(InvalidInputError, match="control character"):
        fetch_image_bytes(f"file://{tmp_path}/{suffix}", allowed_local_media_path=tmp_path)


def test_file_urls_obey_the_byte_cap(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\0" * 2000)
    with pytest.raises(PayloadTooLargeError):
        fetch_image_bytes((tmp_path / "a.png").as_uri(), max_bytes=1000, allowed_local_media_path=tmp_path)


def test_other_url_schemes_are_refused():
    with pytest.raises(InvalidInputError, match="unsupported image URL scheme 'ftp'"):
        fetch_image_bytes("ftp://example.com/a.png", allow_remote=True)
