"""InputProcessor turns prompts, token ids and chat messages (with images) into exactly the token ids, pixel values
and M-RoPE positions transformers' Qwen3-VL pipeline produces, and refuses bad input with errors naming the field."""
from __future__ import annotations

import base64
import copy
import io
import json

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.config import ModelConfig
from engine.errors import ImageError, InvalidInputError, PayloadTooLargeError
from engine.inputs.chat_template import ChatTemplate, load_chat_template
from engine.inputs.image_processor import ImageProcessor
from engine.inputs.processor import InputLimits, InputProcessor
from engine.inputs.tokenizer import load_tokenizer
from tiny_models import image_only_qwen3_vl_processor

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height * width * 3,), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(data.tolist()))


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def make_processor(model_dir, limits: InputLimits | None = None, **image_kwargs) -> InputProcessor:
    config = ModelConfig.from_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    image_processor = ImageProcessor.from_model_dir(model_dir, **image_kwargs) if config.is_multimodal else None
    return InputProcessor(config, tokenizer, load_chat_template(model_dir, tokenizer), image_processor, limits)


@pytest.fixture(scope="module")
def vl(qwen3_vl_dir) -> InputProcessor:
    return make_processor(qwen3_vl_dir)


@pytest.fixture(scope="module")
def reference(qwen3_vl_dir):
    """The transformers pipeline: apply_chat_template -> Qwen3VLProcessor -> Qwen3VLModel.get_rope_index."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_vl_dir)
    config = json.loads((qwen3_vl_dir / "preprocessor_config.json").read_text())
    processor = image_only_qwen3_vl_processor(Qwen2VLImageProcessorPil(**copy.deepcopy(config)), tokenizer)
    model = Qwen3VLModel(Qwen3VLConfig.from_pretrained(qwen3_vl_dir)).eval()

    def run(messages: list[dict], images: list[Image.Image]):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = processor(text=[text], images=images or None, return_tensors="pt")
        positions, delta = model.get_rope_index(out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"],
                                                image_grid_thw=out.get("image_grid_thw"))
        return out, positions[:, 0], int(delta[0, 0])
    return run


A, B, C = noise(100, 70, 1), noise(300, 180, 2), noise(64, 640, 3)
CHATS = {  # name: (messages, the images in the order they appear)
    "text only": ([{"role": "user", "content": "Hello!"}], []),
    "one image": ([{"role": "user", "content": [image_part(A), {"type": "text", "text": "What is this?"}]}], [A]),
    "two images of different sizes": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(B),
                                     {"type": "text", "text": "with"}, image_part(C)]}], [B, C]),
    "image in an earlier turn": ([
        {"role": "user", "content": [image_part(C), {"type": "text", "text": "Describe."}]},
        {"role": "assistant", "content": "A tall strip of noise."},
        {"role": "user", "content": [{"type": "image", "image": A}, {"type": "text", "text": "And this?"}]}], [C, A]),
}


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_matches_the_transformers_pipeline(vl, reference, name):
    messages, images = CHATS[name]
    out, ref_positions, ref_delta = reference(messages, images)
    got = vl.process_chat(messages)
    assert got.prompt_token_ids == out["input_ids"][0].tolist()
    assert len(got.images) == len(images)
    if images:
        assert torch.equal(torch.cat([vl.image_processor.to_pixel_values(it.raw) for it in got.images]), out["pixel_values"])
        assert [it.grid_thw for it in got.images] == [tuple(g) for g in out["image_grid_thw"].tolist()]
    assert torch.equal(got.mrope_positions, ref_positions)
    assert got.mrope_position_delta == ref_delta


def test_image_items_point_at_their_expanded_placeholders(vl):
    messages, _ = CHATS["two images of different sizes"]
    got = vl.process_chat(messages)
    ids, pad = got.prompt_token_ids, vl.model_config.image_token_id
    for item in got.images:
        t, h, w = item.grid_thw
        assert item.length == t * h * w // 4 == vl.image_processor.to_pixel_values(item.raw).shape[0] // 4
        assert ids[item.offset - 1] == vl.model_config.vision_start_token_id
        assert ids[item.offset:item.end] == [pad] * item.length
        assert ids[item.end] == vl.model_config.vision_end_token_id


def test_text_prompt_with_images_expands_like_the_chat(vl):
    messages, images = CHATS["two images of different sizes"]
    chat = vl.process_chat(messages)
    direct = vl.process({"prompt": chat.prompt, "multi_modal_data": {"image": images}})
    assert direct.prompt_token_ids == chat.prompt_token_ids
    assert [it.content_hash for it in direct.images] == [it.content_hash for it in chat.images]


def test_a_single_image_need_not_be_a_list(vl):
    got = vl.process({"prompt": f"Look: {PLACEHOLDER}", "multi_modal_data": {"image": A}})
    assert len(got.images) == 1


def test_token_id_prompts_with_images_expand_too(vl):
    text = vl.process({"prompt": f"Look: {PLACEHOLDER} now", "multi_modal_data": {"image": [B]}})
    ids = vl.tokenizer.encode(f"Look: {PLACEHOLDER} now")
    assert vl.process({"prompt_token_ids": ids, "multi_modal_data": {"image": [B]}}).prompt_token_ids \
        == text.prompt_token_ids


def test_text_prompt_on_qwen3_vl_gets_1d_positions(vl):
    got = vl.process("The capital of France is")
    n = len(got.prompt_token_ids)
    assert torch.equal(got.mrope_positions, torch.arange(n).expand(3, n)) and got.mrope_position_delta == 0


@pytest.mark.parametrize("fixture", ["qwen3_dir", "llama_dir"])
def test_text_models_match_apply_chat_template_and_have_no_mrope(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    proc, tokenizer = make_processor(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    got = proc.process_chat(messages)
    assert got.prompt_token_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                 return_dict=False)
    assert got.mrope_positions is None and got.images == []


@pytest.mark.parametrize("fixture", ["qwen3_dir", "llama_dir", "qwen3_vl_dir"])
def test_string_prompts_use_the_tokenizers_default_special_tokens(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    got = make_processor(model_dir).process("Hello world")
    assert got.prompt_token_ids == AutoTokenizer.from_pretrained(model_dir).encode("Hello world")
    assert got.prompt == "Hello world"


def test_string_only_templates_get_text_parts_joined_by_newlines(qwen3_dir):
    proc = make_processor(qwen3_dir)
    proc.chat_template = ChatTemplate("{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}")
    got = proc.process_chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}])
    assert got.prompt == "user: a\nb\n"


def test_token_ids_pass_through(vl):
    assert vl.process({"prompt_token_ids": [5, 6, 7]}).prompt_token_ids == [5, 6, 7]


def test_content_hash_follows_pixels_not_encoding(qwen3_vl_dir, vl):
    def hashes(proc, images):
        return [it.content_hash for it in proc.process(
            {"prompt": PLACEHOLDER * len(images), "multi_modal_data": {"image": images}}).images]
    same_pixels_other_mode = A.convert("RGBA")
    a, a_again, b = hashes(vl, [A, same_pixels_other_mode, B])
    assert a == a_again != b and len(a) == 64
    capped = make_processor(qwen3_vl_dir, max_pixels=32 * 32 * 4)
    assert hashes(capped, [A]) != [a]  # other processing parameters, other pixel_values


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "non-empty list"),
    ({"prompt_token_ids": [1, True]}, "only integers"),
    ({"prompt_token_ids": [1, 10**6]}, r"token id 1000000 is out of the vocabulary \[0, "),
    ({"prompt_token_ids": [-1]}, "out of the vocabulary"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
    ({"text": "a"}, "unknown prompt field"),
    (42, "must be a string or a dict"),
    ({"prompt": f"{PLACEHOLDER}{PLACEHOLDER}", "multi_modal_data": {"image": [A]}},
     r"2 image placeholder\(s\) but 1 image\(s\)"),
    ({"prompt": "no placeholder", "multi_modal_data": {"image": [A]}}, "0 image placeholder"),
    ({"prompt": "x", "multi_modal_data": {"video": [A]}}, "only images are supported"),
    ({"prompt": "x", "multi_modal_data": {"image": ["cat.png"]}}, "must be a PIL image"),
    ("<|vision_start|><|video_pad|><|vision_end|>", "1 video placeholder.* but the videos given make 0"),
])
def test_bad_prompts_are_refused(vl, prompt, message):
    with pytest.raises(InvalidInputError, match=message):
        vl.process(prompt)


def test_images_on_a_text_model_are_refused(qwen3_dir):
    proc = make_processor(qwen3_dir)
    with pytest.raises(InvalidInputError, match="text-only"):
        proc.process({"prompt": "x", "multi_modal_data": {"image": [A]}})
    with pytest.raises(InvalidInputError, match="text-only") as info:
        proc.process_chat([{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(A)]}])
    assert info.value.param == "messages[0].content[1].image_url"


def test_more_images_than_the_limit_are_refused_before_decoding(qwen3_vl_dir):
    proc = make_processor(qwen3_vl_dir, InputLimits(limit_images_per_prompt=2))
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(InvalidInputError, match="3 images in one prompt, over the limit of 2"):
        proc.process_chat([{"role": "user", "content": [broken] * 3}])
    with pytest.raises(InvalidInputError, match="over the limit of 2"):
        proc.process({"prompt": PLACEHOLDER * 3, "multi_modal_data": {"image": [A] * 3}})


def test_image_limits_apply_to_chat_images(qwen3_vl_dir):
    messages = [{"role": "user", "content": [image_part(B)]}]
    with pytest.raises(ImageError, match="over the limit of 1000"):
        make_processor(qwen3_vl_dir, InputLimits(max_image_pixels=1000)).process_chat(messages)
    with pytest.raises(PayloadTooLargeError) as info:
        make_processor(qwen3_vl_dir, InputLimits(max_image_bytes=1000)).process_chat(messages)
    assert info.value.param == "messages[0].content[0].image_url"


def test_an_image_the_encoder_cannot_take_is_refused_naming_it(vl):
    sliver = noise(402, 2)  # aspect ratio 201:1
    with pytest.raises(ImageError, match="aspect ratio over 200") as info:
        vl.process_chat([{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(sliver)]}])
    assert info.value.param == "messages[0].content[1].image_url"
    with pytest.raises(ImageError, match="aspect ratio over 200") as info:
        vl.process({"prompt": PLACEHOLDER * 2, "multi_modal_data": {"image": [A, sliver]}})
    assert info.value.param == "multi_modal_data.image[1]"


def test_a_chats_images_load_on_the_executor_while_the_prompt_renders(qwen3_vl_dir, monkeypatch):
    import threading

    from engine.inputs import processor as processor_module
    proc = make_processor(qwen3_vl_dir)
    started, threads, real_load = threading.Event(), [], processor_module.decode_image

    def load(*a, **k):
        threads.append(threading.current_thread().name)
        started.set()
        return real_load(*a, **k)
    monkeypatch.setattr(processor_module, "decode_image", load)
    real_render = proc.chat_template.render
    # the template waits until the image has started loading elsewhere: the two overlap
    monkeypatch.setattr(proc.chat_template, "render", lambda *a, **k: started.wait(10) and real_render(*a, **k))
    got = proc.process_chat([{"role": "user", "content": [image_part(noise(64, 64, 7))]}])
    assert len(got.images) == 1 and threads and threads[0].startswith("input")


def test_a_load_still_queued_runs_on_the_thread_that_needs_it(qwen3_vl_dir):
    # In the server process_chat itself runs on the executor: with every worker busy processing a prompt, their
    # images, queued behind them, must not be waited for.
    from concurrent.futures import ThreadPoolExecutor
    proc = make_processor(qwen3_vl_dir)
    proc.executor = ThreadPoolExecutor(max_workers=1)
    messages = [{"role": "user", "content": [image_part(noise(64, 64, i)) for i in range(3)]}]
    got = proc.executor.submit(proc.process_chat, messages).result(timeout=60)
    assert len(got.images) == 3
    proc.shutdown()


def test_the_first_bad_image_in_the_prompt_is_reported(vl):
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    sliver = image_part(noise(402, 2))
    for parts, at, message in (([bad, image_part(noise(64, 64, 7)), sliver], 0, "could not decode image"),
                               ([image_part(noise(64, 64, 8)), sliver, bad], 1, "aspect ratio over 200")):
        with pytest.raises(InvalidInputError, match=message) as info:
            vl.process_chat([{"role": "user", "content": parts}])
        assert info.value.param == f"messages[0].content[{at}].image_url"


@pytest.mark.parametrize("messages, param, message", [
    ([], "messages", "non-empty list"),
    ("hello", "messages", "non-empty list"),
    (["hello"], "messages[0]", "must be an object"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role", "must be one of system, developer, user, assistant"),
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]", "must be an object"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type", "'audio' is not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text", "must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[1].content[0].image_url", "must be"),
    ([{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}], "messages[0].content[0].image",
     "PIL image"),
    ([{"role": "assistant", "content": [image_part(A)]}], "messages[0].content[0]",
     "only accepted in user and tool messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}],
     "messages[0].content[0].image_url", "--allow-remote-media"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "messages[0].content[0].image_url", "could not decode image"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}],
     "messages[0].content[0].image_url", "must be {"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_bad_messages_are_refused_naming_the_field(vl, messages, param, message):
    with pytest.raises(InvalidInputError, match=message) as info:
        vl.process_chat(messages)
    assert info.value.param == param


def test_assistant_tool_calls_may_have_no_content(vl):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18C"}]
    assert "get_weather" in vl.process_chat(messages).prompt


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}])
def test_chat_template_kwargs_cannot_replace_the_templates_own_inputs(vl, kwargs):
    with pytest.raises(InvalidInputError, match="chat_template_kwargs may not set") as info:
        vl.process_chat([{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    assert info.value.param == "chat_template_kwargs"


def test_chat_template_kwargs_reach_the_template(vl):
    messages, _ = CHATS["one image"]
    assert "Picture 1: " in vl.process_chat(messages, chat_template_kwargs={"add_vision_id": True}).prompt


def test_a_model_without_chat_template_refuses_chat(qwen3_dir):
    proc = make_processor(qwen3_dir)
    proc.chat_template = None
    with pytest.raises(InvalidInputError, match="no chat template"):
        proc.process_chat([{"role": "user", "content": "hi"}])
