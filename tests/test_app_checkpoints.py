"""The launcher finds Qwen3-VL-8B-Instruct in the Hugging Face cache in bf16 and in quantized forms (FP8, AWQ,
GPTQ, compressed-tensors), tells them apart by their config.json, computes their weight sizes from the shapes,
and picks the most precise one that fits the GPU, saying why and what else it found."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from app.checkpoints import (BF16, GB, GiB, RUNTIME_BYTES, VISION_PROBE, CachedCheckpoint, choose,
                             decoder_linear_shapes, gpu_memory, other_params, parse_nvidia_smi,
                             vision_bytes, vision_linear_shapes, weight_bytes, weight_format)
from app.models import resolve_model
from engine.errors import ModelLoadError
from engine.model.quantization.parse import parse_quantization_config
from test_app_launcher import clean_env, fake_snapshot  # noqa: F401  (clean_env is a fixture)

REFERENCE = json.loads(open(__file__.rsplit("/", 2)[0] + "/bench/model_configs/qwen3-vl-8b-instruct/config.json")
                       .read())

# quantization_config as the published checkpoints write it
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.visual"]}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": ["visual"]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
        "modules_to_not_convert": ["visual"]}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*visual.*"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
CT_FP8_DYNAMIC = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
    "group_0": {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}}
BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True}


def with_quant(q: dict | None) -> dict:
    return {**REFERENCE, "quantization_config": q} if q else REFERENCE


# ---- formats -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q, name, bits", [
    (None, "bf16", 16), (QWEN_FP8, "fp8", 8), (AWQ, "awq 4-bit g128", 4), (GPTQ, "gptq 4-bit g128", 4),
    (CT_W4A16, "compressed-tensors 4-bit g128", 4)])
def test_format_comes_from_quantization_config(q, name, bits):
    fmt = weight_format(with_quant(q))
    assert (fmt.name, fmt.bits) == (name, bits)


@pytest.mark.parametrize("q", [
    BNB, CT_FP8_DYNAMIC, {**QWEN_FP8, "weight_block_size": None}, {**AWQ, "zero_point": False},
    {**GPTQ, "checkpoint_format": "gptq_v2"}, {**CT_W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}])
def test_a_checkpoint_the_engine_refuses_is_refused_with_the_engines_reason(q):
    """One parser: the launcher reads quantization_config with the engine's, so it never offers a checkpoint
    the engine would refuse at load, and says why in the engine's words."""
    with pytest.raises(ModelLoadError) as refused:
        parse_quantization_config(q)
    assert weight_format(with_quant(q)) == refused.value.message


@pytest.mark.parametrize("ignore, vision_quantized", [
    (["lm_head", "model.visual"], False),                 # a parent module: its blocks are kept too
    (["lm_head", "visual.blocks.0.attn.qkv"], False),     # a trailing part of the name, as vLLM reads it
    (["re:.*visual.*"], False), (["lm_head"], True)])
def test_the_vision_tower_is_excluded_as_the_engine_matches_names(ignore, vision_quantized):
    fmt = weight_format(with_quant({**CT_W4A16, "ignore": ignore}))
    assert fmt.vision_quantized is vision_quantized
    engine_scheme = parse_quantization_config({**CT_W4A16, "ignore": ignore}).scheme_for(VISION_PROBE)
    assert (engine_scheme is not None) is vision_quantized


# ---- sizes -----------------------------------------------------------------------------------------------------
def test_parameter_count_of_the_8b_matches_the_meta_device_count():
    linear = sum(o * i for o, i in decoder_linear_shapes(REFERENCE))
    assert linear == 36 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 12288)       # 6.95 G
    vision = sum(o * i for o, i in vision_linear_shapes(REFERENCE))
    assert vision == 27 * (1152 * 3456 + 1152 * 1152 + 2 * 1152 * 4304)                # 0.41 G
    assert linear + vision + other_params(REFERENCE) == 8_767_123_696   # QWEN3_VL.md: built on the meta device


def test_weight_bytes_per_format():
    """What the engine holds: integer weights repacked with a bf16 scale and zero point per group (symmetric or
    not), fp8 with a float32 scale per 128x128 block; embeddings, lm_head and the vision tower in bf16."""
    linear = sum(o * i for o, i in decoder_linear_shapes(REFERENCE))
    kept = 2 * (sum(o * i for o, i in vision_linear_shapes(REFERENCE)) + other_params(REFERENCE))
    assert weight_bytes(REFERENCE, BF16) == 2 * 8_767_123_696
    blocks = sum(-(-o // 128) * -(-i // 128) for o, i in decoder_linear_shapes(REFERENCE))
    assert weight_bytes(REFERENCE, weight_format(with_quant(QWEN_FP8))) == linear + 4 * blocks + kept
    groups = linear // 128
    for q in (GPTQ, AWQ, CT_W4A16):
        assert weight_bytes(REFERENCE, weight_format(with_quant(q))) == linear // 2 + 2 * groups + 2 * groups + kept
    assert round(weight_bytes(REFERENCE, weight_format(with_quant(QWEN_FP8))) / GB, 2) == 10.59
    assert round(weight_bytes(REFERENCE, weight_format(with_quant(AWQ))) / GB, 2) == 7.33


@pytest.mark.parametrize("q, vision_quantized, gb", [
    (QWEN_FP8, False, 10.59),
    ({**QWEN_FP8, "modules_to_not_convert": ["lm_head", "model.visual.merger", "model.visual.deepstack_merger_list"]},
     True, 10.59),
    ({**AWQ, "modules_to_not_convert": None}, True, 7.33),
    (CT_W4A16, False, 7.33), ({**CT_W4A16, "ignore": ["lm_head"]}, True, 7.33)])
def test_a_vision_tower_shipped_quantized_takes_its_bf16_bytes_on_the_gpu(q, vision_quantized, gb):
    """The engine dequantizes quantized vision blocks once at load (engine/model/loader.py), so whether the
    exclusion list covers them changes the checkpoint's files, not the GPU memory."""
    fmt = weight_format(with_quant(q))
    assert fmt.vision_quantized is vision_quantized
    assert round(weight_bytes(REFERENCE, fmt) / GB, 2) == gb


# ---- the choice ------------------------------------------------------------------------------------------------
def checkpoint(repo: str, q: dict | None) -> CachedCheckpoint:
    fmt = weight_format(with_quant(q))
    return CachedCheckpoint(repo, None, fmt, weight_bytes(REFERENCE, fmt))


FOUND = [checkpoint("Qwen/Qwen3-VL-8B-Instruct", None), checkpoint("Qwen/Qwen3-VL-8B-Instruct-FP8", QWEN_FP8),
         checkpoint("someone/Qwen3-VL-8B-Instruct-AWQ", AWQ)]


@pytest.mark.parametrize("gib, repo", [(80, "Qwen/Qwen3-VL-8B-Instruct"), (24, "Qwen/Qwen3-VL-8B-Instruct"),
                                       (16, "Qwen/Qwen3-VL-8B-Instruct-FP8"), (12, "someone/Qwen3-VL-8B-Instruct-AWQ")])
def test_the_most_precise_checkpoint_that_fits_the_gpu(gib, repo):
    choice = choose(FOUND, ("GPU", gib * GiB))
    assert choice.checkpoint.repo == repo and "the most precise one that fits GPU" in choice.reason
    assert choice.checkpoint.needs == choice.checkpoint.weights + RUNTIME_BYTES <= gib * GiB
    assert {c.repo for c in choice.others} == {c.repo for c in FOUND} - {repo}


def test_when_none_fits_the_smallest_whose_flags_the_launcher_then_fits():
    choice = choose(FOUND, ("RTX 3070", 8 * GiB))
    assert choice.checkpoint.repo == "someone/Qwen3-VL-8B-Instruct-AWQ"
    assert "none fits RTX 3070 (8 GiB)" in choice.reason and "fits the engine's flags to the card" in choice.reason


def test_with_tensor_parallelism_each_gpu_holds_a_share_and_the_whole_vision_tower():
    """Two 12 GiB cards hold bf16 split in two (one card alone takes the 4-bit); the vision tower is not split."""
    found = [replace(c, replicated=vision_bytes(REFERENCE)) for c in FOUND]
    assert choose(found, ("RTX 3060", 12 * GiB)).checkpoint.repo == "someone/Qwen3-VL-8B-Instruct-AWQ"
    choice = choose(found, ("RTX 3060", 12 * GiB), tensor_parallel_size=2)
    assert choice.checkpoint.repo == "Qwen/Qwen3-VL-8B-Instruct" and "2 x RTX 3060" in choice.reason
    bf16 = choice.checkpoint
    assert bf16.needs_per_gpu(2) == (bf16.weights - bf16.replicated) // 2 + bf16.replicated + RUNTIME_BYTES
    assert bf16.needs_per_gpu(2) > bf16.weights // 2 + RUNTIME_BYTES        # the tower counts whole
    assert choose(found, ("RTX 3080", 10 * GiB), tensor_parallel_size=2).checkpoint.repo.endswith("-FP8")


def test_the_smallest_of_the_gpus_tensor_parallelism_uses():
    out = "NVIDIA GeForce RTX 3060, 12288\nNVIDIA GeForce RTX 3090, 24576\nNVIDIA GeForce RTX 4060, 8192\n"
    assert parse_nvidia_smi(out, None, 2) == ("NVIDIA GeForce RTX 3060", 12 * GiB)
    assert parse_nvidia_smi(out, None, 3) == ("NVIDIA GeForce RTX 4060", 8 * GiB)
    assert parse_nvidia_smi(out, "1,0", 2) == ("NVIDIA GeForce RTX 3060", 12 * GiB)
    assert parse_nvidia_smi(out, "1", 2) is None                               # one visible, two asked for


def test_without_a_gpu_bf16_else_the_most_precise():
    assert choose(FOUND, None).checkpoint.repo == "Qwen/Qwen3-VL-8B-Instruct"
    assert choose(FOUND[1:], None).checkpoint.repo == "Qwen/Qwen3-VL-8B-Instruct-FP8"
    official_first = [checkpoint("someone/Qwen3-VL-8B-Instruct-FP8-block", QWEN_FP8), FOUND[1]]
    assert choose(official_first, None).checkpoint.repo == "Qwen/Qwen3-VL-8B-Instruct-FP8"


# ---- the cache, end to end -----------------------------------------------------------------------------------
def test_resolve_picks_from_the_cache_and_says_why(clean_env, tmp_path):
    hf = tmp_path / "hf"
    fake_snapshot(hf, config=REFERENCE)
    fp8 = fake_snapshot(hf, repo_dir="models--Qwen--Qwen3-VL-8B-Instruct-FP8", config=with_quant(QWEN_FP8))
    fake_snapshot(hf, repo_dir="models--someone--Qwen3-VL-8B-Instruct-AWQ-4bit", config=with_quant(AWQ))
    fake_snapshot(hf, repo_dir="models--someone--Qwen3-VL-8B-Instruct-GPTQ-Int4", config=with_quant(GPTQ),
                  present=["model-00001-of-00002.safetensors"])             # an interrupted download
    fake_snapshot(hf, repo_dir="models--someone--Qwen3-VL-8B-Instruct-bnb-4bit", config=with_quant(BNB))
    fake_snapshot(hf, repo_dir="models--Qwen--Qwen3-VL-8B-Thinking-FP8", config=with_quant(QWEN_FP8))
    fake_snapshot(hf, repo_dir="models--someone--Qwen3-VL-8B-Instruct-abliterated", config=REFERENCE)

    resolved = resolve_model(None, clean_env, gpu=lambda env, n: ("NVIDIA GeForce RTX 4080", 16 * GiB))
    assert resolved.path == fp8 and resolved.served_name == "Qwen3-VL-8B-Instruct-FP8" and not resolved.demo
    notes = "\n".join(resolved.notes)
    assert notes.startswith("chosen from the Hugging Face cache: Qwen/Qwen3-VL-8B-Instruct-FP8 (fp8, weights "
                            "~10.6 GB, needs ~14 GB); the most precise one that fits NVIDIA GeForce RTX 4080 (16 GiB; a "
                            "checkpoint needs its weights + ~3.5 GB at run time)")
    assert "also found: Qwen/Qwen3-VL-8B-Instruct (bf16, weights ~17.5 GB, needs ~21 GB)" in notes
    assert "also found: someone/Qwen3-VL-8B-Instruct-AWQ-4bit (awq 4-bit g128, weights ~7.3 GB" in notes
    assert ("someone/Qwen3-VL-8B-Instruct-bnb-4bit (not used: unsupported quantized checkpoint: quantization "
            "method 'bitsandbytes'") in notes
    for absent in ("GPTQ", "Thinking", "abliterated"):
        assert absent not in notes
    assert "--model <its snapshot folder>" in notes

    big = resolve_model(None, clean_env, gpu=lambda env, n: ("NVIDIA H200", 140 * GiB))
    assert big.served_name == "Qwen3-VL-8B-Instruct" and big.path.parts[-3] == "models--Qwen--Qwen3-VL-8B-Instruct"


def test_only_bf16_cached_needs_no_notes_beyond_the_choice(clean_env, tmp_path):
    snap = fake_snapshot(tmp_path / "hf")
    resolved = resolve_model(None, clean_env, gpu=lambda env, n: None)
    assert resolved.path == snap and resolved.notes == (
        "chosen from the Hugging Face cache: Qwen/Qwen3-VL-8B-Instruct (bf16, weights ~17.5 GB, needs ~21 GB); "
        "no NVIDIA GPU found (nvidia-smi): the most precise checkpoint",)


# ---- the GPU's memory ------------------------------------------------------------------------------------------
def test_nvidia_smi_output_is_read_for_the_visible_gpu():
    out = "NVIDIA GeForce RTX 3060, 12288\nNVIDIA H200, 143771\n"
    assert parse_nvidia_smi(out, None) == ("NVIDIA GeForce RTX 3060", 12 * GiB)
    assert parse_nvidia_smi(out, "1,0") == ("NVIDIA H200", 143771 * 2**20)
    assert parse_nvidia_smi(out, "GPU-5f3c") == ("NVIDIA GeForce RTX 3060", 12 * GiB)   # a UUID: the first
    assert parse_nvidia_smi(out, "7") is None
    assert parse_nvidia_smi("No devices were found", None) is None


def test_the_gpu_size_can_be_stated():
    assert gpu_memory({"LOCALCHAT_GPU_MEMORY_GIB": "12"}) == ("LOCALCHAT_GPU_MEMORY_GIB", 12 * GiB)

