"""IncrementalDetokenizer streams exactly the text tokenizer.decode gives for the whole output, in pieces that
never end in half a character, decoding only a short window per step."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.inputs.detokenizer import IncrementalDetokenizer
from engine.inputs.tokenizer import load_tokenizer

TEXT = "Hello! Unicode: café, naïve, 日本語, 中文, emoji 🙂 and ü. The capital of France is Paris."


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request):
    if request.param == "tiny":
        return AutoTokenizer.from_pretrained(request.getfixturevalue("qwen3_vl_dir"))
    return load_tokenizer(request.getfixturevalue("smollm2_gguf"))


def byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` as one byte-level token per UTF-8 byte: every multi-byte character split across tokens."""
    byte_char = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([byte_char[b] for b in text.encode()])


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed `ids` in random chunks of 1-3 tokens (one step may accept several, e.g. with speculative decoding)."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    return deltas


@pytest.mark.parametrize("seed", range(12))
def test_random_token_streams_concatenate_to_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    specials = tokenizer.all_special_ids
    ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tokenizer)) for _ in range(80)]
    prompt = tokenizer.encode("The capital of France is")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = stream(detok, ids, rng)
    deltas.append(detok.flush())
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full == detok.output_text
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(4))
def test_characters_split_across_byte_tokens_are_never_emitted_broken(tokenizer, seed):
    ids = byte_tokens(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say something:"))
    deltas = stream(detok, ids, random.Random(seed))
    assert "".join(deltas) == TEXT == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""


def test_an_emoji_appears_only_when_its_last_byte_arrives(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    emoji = byte_tokens(tokenizer, "🙂")
    assert [detok.add([t]) for t in emoji] == ["", "", "", "🙂"]


def test_ordinary_text_streams_token_by_token(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    assert "".join(detok.add([t]) for t in ids) == TEXT
    assert detok.output_token_ids == ids


def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Paris", add_special_tokens=False) + [eos]
    skipping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skipping.add([t]) for t in ids) == "Paris"
    assert "".join(keeping.add([t]) for t in ids) == "Paris" + tokenizer.eos_token


def test_a_prompt_ending_mid_character_does_not_corrupt_the_first_delta(tokenizer):
    emoji = byte_tokens(tokenizer, "🙂")
    prompt = tokenizer.encode("Look:", add_special_tokens=False) + emoji[:2]   # token ids sent by a client
    detok = IncrementalDetokenizer(tokenizer, prompt)
    output = emoji[2:] + tokenizer.encode(" ok", add_special_tokens=False)
    text = "".join(detok.add([t]) for t in output) + detok.flush()
    assert text == tokenizer.decode(output, skip_special_tokens=True)


def test_invalid_bytes_at_the_end_are_released_by_flush(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    ids = tokenizer.encode("ok", add_special_tokens=False) + byte_tokens(tokenizer, "🙂")[:1]
    assert "".join(detok.add([t]) for t in ids) == "ok"
    assert detok.flush() == "\ufffd" and detok.output_text == tokenizer.decode(ids)


def test_each_step_decodes_a_short_window_not_the_whole_output(tokenizer):
    calls: list[int] = []
    original = tokenizer.decode

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return original(ids, **kwargs)

    ids = tokenizer.encode(TEXT * 8, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), tokenizer.encode("Prompt: hello there"))
    assert "".join(detok.add([t]) for t in ids) == TEXT * 8
    assert len(ids) > 150 and max(calls) <= 6
