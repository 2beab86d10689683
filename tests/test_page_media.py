"""The chat page's media (bench: page_bench.py): a video attached and sent as a video_url part with the frames
chosen, a PDF's chosen pages sent as images, text files inlined, and the model's boxes and points drawn on the
image they are about; each kept in the chat across a reload. The video's answer comes through page.route (the
request as it leaves the browser); the others through the fake stream of browser_helpers.py."""
from __future__ import annotations

import base64
import io
import json
import re
import zlib

import pytest
from PIL import Image

from browser_helpers import browser, delta, expect, last_answer, reload, script_replies, send, sent_requests, sse  # noqa: F401
from page_bench import answer_done, chat, open_page, page_proxy, png_file, sent_images  # noqa: F401
from proxy.page import available_vendor
from servers import REPO

pytestmark = [pytest.mark.browser]



# ---- video --------------------------------------------------------------------------------------------------
# A clip recorded by the browser itself (MediaRecorder on a canvas, H.264 in MP4): no binary fixture.
RECORD_MP4 = """async ({ms, w, h}) => {
  const canvas = Object.assign(document.createElement('canvas'), { width: w, height: h });
  const ctx = canvas.getContext('2d');
  const recorder = new MediaRecorder(canvas.captureStream(30), { mimeType: 'video/mp4;codecs=avc1' });
  const parts = [];
  recorder.ondataavailable = (e) => parts.push(e.data);
  let i = 0;
  const draw = () => { ctx.fillStyle = `hsl(${(i++ * 15) % 360} 80% 50%)`; ctx.fillRect(0, 0, w, h); };
  draw();
  const timer = setInterval(draw, 33);
  recorder.start();
  await new Promise((r) => setTimeout(r, ms));
  const stopped = new Promise((r) => { recorder.onstop = r; });
  recorder.stop();
  await stopped;
  clearInterval(timer);
  const bytes = new Uint8Array(await new Blob(parts).arrayBuffer());
  let s = '';
  for (const b of bytes) s += String.fromCharCode(b);
  return btoa(s);
}"""


def recorded_mp4(page, seconds=1.2, size=(160, 96)) -> bytes:
    return base64.b64decode(page.evaluate(RECORD_MP4, {"ms": int(seconds * 1000), "w": size[0], "h": size[1]}))


def answer_through_route(page, text="A colourful square."):
    """Answers every chat request with a canned SSE stream; returns the request bodies as they left the page."""
    bodies = []

    def handle(route):
        bodies.append(route.request.post_data_json)
        words = text.split(" ")
        chunks = [delta(w + ("" if i == len(words) - 1 else " ")) for i, w in enumerate(words)]
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 60, "completion_tokens": len(chunks), "total_tokens": 60 + len(chunks)}}
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse(*chunks, done, "[DONE]"))

    page.route("**/v1/chat/completions", handle)
    return bodies


def video_parts(body) -> list[str]:
    return [p["video_url"]["url"] for m in body["messages"] if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "video_url"]


def test_a_video_goes_with_its_frames_and_stays_in_the_chat(chat):
    open_page(chat, video={"max_frames": 8}, max_videos_per_prompt=1)
    mp4 = recorded_mp4(chat)
    assert mp4[4:8] == b"ftyp"
    bodies = answer_through_route(chat)
    chat.set_input_files("#file-input", [{"name": "clip.mp4", "mimeType": "video/mp4", "buffer": mp4}])
    card = chat.locator(".video-card")
    expect(card).to_have_count(1)
    expect(card.locator(".video-duration")).to_have_text("0:01")
    expect(card.locator(".video-size")).to_have_text("160×96")
    # 1.2 s at 2 fps is 2 frames, raised to the processor's minimum of 4; 160×96 frames are 5×3 tokens a
    # temporal patch of 2 frames.
    expect(card.locator(".video-cost")).to_have_text("4 frames · ≈ 30 tokens")
    assert card.locator(".video-poster img").get_attribute("src").startswith("data:image/jpeg;base64,")
    expect(chat.locator("#context-meter")).to_have_attribute("data-pending", "30")
    card.locator(".video-frames").fill("2")                 # fewer frames
    expect(card.locator(".video-cost")).to_have_text("2 frames · ≈ 15 tokens")
    chat.wait_for_timeout(600)                              # the draft is written a moment after the change
    reload(chat)                                            # the draft keeps the clip and its frames
    expect(card.locator(".video-cost")).to_have_text("2 frames · ≈ 15 tokens")

    send(chat, "What happens in this clip?")
    expect(answer_done(chat).locator(".content")).to_have_text("A colourful square.")
    sent = bodies[-1]
    assert video_parts(sent) == ["data:video/mp4;base64," + base64.b64encode(mp4).decode()]
    assert sent["messages"][-1]["content"][-1] == {"type": "text", "text": "What happens in this clip?"}
    assert sent["mm_processor_kwargs"] == {"num_frames": 2}
    expect(chat.locator(".msg.user video")).to_have_count(1)
    expect(chat.locator(".msg.user .msg-video figcaption")).to_contain_text("2 frames sent")

    reload(chat)                                            # kept in IndexedDB, sent again when regenerated
    expect(chat.locator(".msg.user video")).to_have_count(1)
    assert chat.locator(".msg.user video").get_attribute("src").startswith("data:video/mp4;base64,")
    last_answer(chat).locator(".act-regenerate").click()
    answer_done(chat)
    assert video_parts(bodies[-1]) == video_parts(sent) and bodies[-1]["mm_processor_kwargs"] == {"num_frames": 2}
    # An edited question keeps its video.
    chat.locator(".msg.user .act-edit").click()
    chat.fill(".edit-text", "And in slow motion?")
    chat.press(".edit-text", "Enter")
    answer_done(chat)
    assert video_parts(bodies[-1]) == video_parts(sent)
    assert bodies[-1]["messages"][-1]["content"][-1]["text"] == "And in slow motion?"


def test_the_frame_count_and_token_cost_follow_the_processor(chat):
    """The page's arithmetic against transformers' Qwen3-VL video smart_resize, with Qwen3-VL's video
    processor settings (fps 2, at least 4 frames, at most 25,165,824 pixels over all frames) and the engine's
    limit of 64 frames."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    open_page(chat)
    clips = [(10, 720, 1280), (60, 720, 1280), (3.3, 1080, 1920), (0.5, 100, 30), (30, 4000, 3000)]
    got = chat.evaluate("""async (clips) => {
      const v = await import('/static/video_attach.js');
      return clips.map(([duration, height, width]) => {
        const frames = v.defaultFrames(duration);
        return [frames, v.frameSize(frames, height, width), v.videoTokens({ frames, height, width })];
      });
    }""", clips)
    for (duration, height, width), (frames, size, tokens) in zip(clips, got):
        want_frames = min(max(int(duration * 2), 4), 64)
        h, w = smart_resize(want_frames, height, width, temporal_factor=2, factor=32, min_pixels=4096,
                            max_pixels=25165824)
        assert (frames, size, tokens) == (want_frames, [h, w], -(-want_frames // 2) * (h // 32) * (w // 32))


# ---- PDF ----------------------------------------------------------------------------------------------------
PAGE_COLOURS = [(1, 0, 0), (0, 0.6, 0), (0, 0, 1)]


def three_page_pdf() -> bytes:
    """A valid 3-page PDF, written by hand: each page a coloured field with its number on it."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R 5 0 R 7 0 R] /Count 3 >>"]
    for n, (r, g, b) in enumerate(PAGE_COLOURS, start=1):
        ops = f"{r} {g} {b} rg 0 0 300 200 re f 1 1 1 rg BT /F1 48 Tf 110 80 Td (p{n}) Tj ET".encode()
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 200] /Contents {len(objects) + 2} 0 R "
                       "/Resources << /Font << /F1 9 0 R >> >> >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(ops), ops))
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def main_colour(data_url) -> tuple[int, int, int]:
    img = Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB")
    return img.getpixel((10, 10)), img.size


@pytest.mark.skipif("pdfjs" not in available_vendor(REPO / "static"),
                    reason="pdf.js is not installed (web/install_vendor.sh needs npm)")
def test_the_chosen_pages_of_a_pdf_go_as_images(chat):
    open_page(chat, max_images_per_prompt=2)
    chat.set_input_files("#file-input", [{"name": "report.pdf", "mimeType": "application/pdf", "buffer": three_page_pdf()}])
    picker = chat.locator("#pdf-picker")
    expect(picker).to_be_visible()
    expect(picker.locator(".pdf-head")).to_have_text("report.pdf: 3 pages")
    boxes = picker.locator("input[type=checkbox]")
    expect(boxes).to_have_count(3)
    assert [boxes.nth(i).is_checked() for i in range(3)] == [True, True, False]   # as many as the model takes
    expect(picker.locator(".pdf-note")).to_contain_text("can take 2 more images")
    expect(picker.locator(".pdf-thumb canvas")).to_have_count(3)                  # the pages, drawn by pdf.js
    boxes.nth(2).check()
    expect(picker.locator(".pdf-attach")).to_be_disabled()
    expect(picker.locator(".pdf-note")).to_contain_text("Too many pages")
    boxes.nth(1).uncheck()
    picker.locator(".pdf-attach").click()
    expect(picker).to_be_hidden()
    expect(chat.locator(".thumb figcaption")).to_have_text(["p. 1", "p. 3"])

    script_replies(chat, {"chunks": ["Red, then blue."]})
    send(chat, "Which colours?")
    answer_done(chat)
    images = sent_images(sent_requests(chat)[-1])[-1]
    assert len(images) == 2
    (first, size), (third, _) = main_colour(images[0]), main_colour(images[1])
    assert size == (1280, 853)                              # 300×200 points, the longest side at 1280 pixels
    assert first[0] > 200 and first[2] < 60 and third[2] > 200 and third[0] < 60, (first, third)
    reload(chat)
    expect(chat.locator(".msg.user img")).to_have_count(2)
    assert [chat.locator(".msg.user img").nth(i).get_attribute("alt") for i in range(2)] == ["report.pdf p. 1", "report.pdf p. 3"]


# ---- text files ---------------------------------------------------------------------------------------------
def test_a_text_file_is_inlined_with_its_name_and_counted(chat):
    open_page(chat)
    chat.set_input_files("#file-input", [{"name": "data.csv", "mimeType": "text/csv", "buffer": b"a,b\n1,2\n3,```4\n"}])
    chip = chat.locator(".file-chip")
    expect(chip).to_contain_text("data.csv")
    expect(chip).to_contain_text("3 lines · 15 B · ≈ 10 tokens")   # the 37 characters sent, 4 a token
    expect(chat.locator("#context-meter .meter-text")).to_have_text("Context 0 +≈10 / 4,096 tokens")
    # Refused with what to do: too large, not text, not a kind the page takes.
    chat.set_input_files("#file-input", [{"name": "big.log", "mimeType": "text/plain", "buffer": b"x" * (600 * 1024)}])
    expect(chat.locator("#error")).to_contain_text("text files up to 512.0 KB can be attached")
    chat.set_input_files("#file-input", [{"name": "odd.txt", "mimeType": "text/plain", "buffer": b"ab\x00cd"}])
    expect(chat.locator("#error")).to_contain_text("“odd.txt” is not a text file")
    chat.set_input_files("#file-input", [{"name": "a.zip", "mimeType": "application/zip", "buffer": b"PK\x03\x04"}])
    expect(chat.locator("#error")).to_contain_text("“a.zip” cannot be attached")
    expect(chip).to_have_count(1)

    script_replies(chat, {"chunks": ["Column b sums to 6."]})
    send(chat, "Sum column b")
    answer_done(chat)
    # The file's text as the model reads it: its name, then a fence longer than the backticks inside.
    assert sent_requests(chat)[-1]["messages"][-1] == {
        "role": "user", "content": "data.csv:\n````csv\na,b\n1,2\n3,```4\n````\n\nSum column b"}
    reload(chat)
    expect(chat.locator(".msg.user .msg-file summary")).to_contain_text("data.csv")
    script_replies(chat, {"chunks": ["Still 6."]})
    last_answer(chat).locator(".act-regenerate").click()
    answer_done(chat)
    assert sent_requests(chat)[-1]["messages"][-1]["content"].startswith("data.csv:\n````csv\n")


# ---- grounding ----------------------------------------------------------------------------------------------
GROUNDED = ('Here they are:\n\n```json\n[\n  {"bbox_2d": [100, 200, 500, 800], "label": "cat <b>bold</b>"},\n'
            '  {"point_2d": [750, 250], "label": "nose"}\n]\n```')


def test_marks_are_read_from_the_models_json_only(chat):
    open_page(chat)
    text = ('{"bbox_2d": [900, 800, 100, 1200], "label": 7} {"bbox_2d": [1, 2, 3]} {"point_2d": ["a", 2]} '
            '{"point_2d": [5, 6] oops} <b>{"point_2d": [-10, 500]}</b>')
    marks = chat.evaluate("async (t) => (await import('/static/grounding.js')).findMarks(t)", text)
    assert marks == [{"kind": "box", "x1": 100, "y1": 800, "x2": 900, "y2": 1000, "label": "7"},   # ordered, clamped
                     {"kind": "point", "x": 0, "y": 500, "label": ""}]


def rect(locator):
    return locator.evaluate("e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; }")


def assert_marks_on(stage):
    """The box and the point sit where their 0–1000 coordinates say on the image as displayed."""
    x, y, w, h = rect(stage.locator("img"))
    bx, by, bw, bh = rect(stage.locator(".mark-box"))
    want = (x + 0.1 * w, y + 0.2 * h, 0.4 * w, 0.6 * h)
    assert all(abs(a - b) < 1.0 for a, b in zip((bx, by, bw, bh), want)), ((bx, by, bw, bh), want)
    px, py, pw, ph = rect(stage.locator(".mark-point"))
    assert abs(px + pw / 2 - (x + 0.75 * w)) < 1.0 and abs(py + ph / 2 - (y + 0.25 * h)) < 1.0
    return w, h


def test_boxes_and_points_in_an_answer_are_drawn_on_the_image(chat, tmp_path):
    open_page(chat)
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "old.png", size=(80, 80), color=(0, 0, 200)))])
    script_replies(chat, {"chunks": ["A blue square."]})
    send(chat, "What is this?")
    answer_done(chat)
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "cat.png", size=(600, 300)))])
    script_replies(chat, {"chunks": [GROUNDED[:40], GROUNDED[40:90], GROUNDED[90:]]})
    send(chat, "Where is the cat?")
    figure = answer_done(chat).locator(".grounding")
    expect(figure).to_have_count(1)
    expect(figure.locator(".ground-summary")).to_have_text("1 box, 1 point on cat.png")   # the latest image
    stage = figure.locator(".ground-stage")
    w, h = assert_marks_on(stage)
    assert abs(w / h - 2) < 0.02
    # Labels are the model's text, never markup.
    expect(stage.locator(".mark-label").first).to_have_text("cat <b>bold</b>")
    expect(stage.locator(".mark-label b")).to_have_count(0)

    chat.set_viewport_size({"width": 1000, "height": 820})          # a smaller image: the marks follow it
    assert assert_marks_on(stage)[0] < w
    figure.locator(".ground-toggle").click()
    expect(stage.locator(".ground-marks")).to_be_hidden()
    figure.locator(".ground-toggle").click()
    expect(stage.locator(".ground-marks")).to_be_visible()
    stage.click()                                                    # the larger view, marks included
    zoomed = chat.locator("dialog.ground-zoom .ground-stage")
    expect(zoomed).to_be_visible()
    assert assert_marks_on(zoomed)[0] > w
    chat.keyboard.press("Escape")
    expect(chat.locator("dialog.ground-zoom")).to_have_count(0)
    figure.locator(".ground-image").select_option("0")              # the chat's other image
    expect(last_answer(chat).locator(".ground-summary")).to_have_text("1 box, 1 point on old.png")

    reload(chat)
    figure = last_answer(chat).locator(".grounding")
    expect(figure.locator(".ground-summary")).to_have_text("1 box, 1 point on cat.png")
    assert_marks_on(figure.locator(".ground-stage"))


def test_find_asks_for_boxes_on_an_image(chat, tmp_path):
    open_page(chat)
    for i, name in enumerate(("first.png", "second.png")):
        chat.set_input_files("#file-input", [str(png_file(tmp_path, name))])
        script_replies(chat, {"chunks": ["Seen."]})
        send(chat, f"Look at {name}")
        answer_done(chat, i)                   # this answer's (the last one may still be the one before)
    images = chat.locator(".msg.user .msg-image")
    images.nth(1).hover()
    images.nth(1).locator(".find").click()                # the latest image: no need to send it again
    expect(chat.locator("#prompt")).to_have_value(
        "Locate every <thing> in this image and output bbox_2d coordinates in JSON.")
    assert chat.evaluate("(() => { const p = document.getElementById('prompt'); "
                         "return p.value.slice(p.selectionStart, p.selectionEnd); })()") == "<thing>"
    expect(chat.locator(".thumb")).to_have_count(0)
    images.nth(0).hover()
    images.nth(0).locator(".find").click()                # an earlier one goes with the question
    expect(chat.locator(".thumb img")).to_have_attribute("alt", "first.png")
    chat.keyboard.type("dog")
    script_replies(chat, {"chunks": ['{"bbox_2d": [0, 0, 1000, 1000], "label": "dog"}']})
    chat.press("#prompt", "Enter")
    answer_done(chat, 2)
    assert sent_requests(chat)[-1]["messages"][-1]["content"][-1]["text"] == (
        "Locate every dog in this image and output bbox_2d coordinates in JSON.")
    expect(last_answer(chat).locator(".ground-summary")).to_have_text("1 box on first.png")
