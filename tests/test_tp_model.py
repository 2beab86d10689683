"""The tensor-parallel model: on N CPU ranks (gloo) the sharded model computes the logits of the whole model.

Each case builds the model directly (build_model + load_weights + a CacheEngine), runs a batched prefill of two
sequences and a decode step with hand-made AttentionMetadata, and returns the logits; TP=2 and TP=4 (where the
heads allow) must equal TP=1 within fp32 rounding on every rank. Spawned ranks cost seconds, so one spawned group
runs many cases."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.worker.cache_engine import CacheEngine
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model.loader import build_model, load_model_config, load_weights
from engine.ops import AttentionMetadata
from quant_checkpoints import Spec, write_quantized
from tp_helpers import run_tensor_parallel

BLOCK = 16
CPU = torch.device("cpu")
GRID = (1, 4, 6)                   # one image of 4 x 6 patches: 6 merged tokens


# ---- what every rank runs --------------------------------------------------------------------------------------
def _metadata(starts: list[int], query_lens: list[int], num_decodes: int) -> AttentionMetadata:
    """Sequence i owns KV block i and computes query_lens[i] tokens from position starts[i]."""
    slots = torch.cat([torch.arange(i * BLOCK + s, i * BLOCK + s + q) for i, (s, q) in enumerate(zip(starts, query_lens))])
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [s + q for s, q in zip(starts, query_lens)]
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(len(starts), dtype=torch.int32)[:, None], num_decodes=num_decodes,
        num_decode_tokens=num_decodes, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def _prompts(config: ModelConfig, image: bool) -> tuple[list[list[int]], dict | None]:
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randint(0, 300, (11,), generator=gen).tolist(), torch.randint(0, 300, (6,), generator=gen).tolist()
    if not image:
        return [a, b], None
    pads = GRID[0] * GRID[1] * GRID[2] // config.vision.spatial_merge_size ** 2
    a = a[:3] + [config.vision_start_token_id] + [config.image_token_id] * pads + [config.vision_end_token_id] + a[3:6]
    v = config.vision
    pixels = torch.randn(GRID[0] * GRID[1] * GRID[2], v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                         generator=gen)
    return [a, b], {"pixels": pixels, "grid": torch.tensor([GRID])}


def _positions(config: ModelConfig, prompts, image) -> tuple[torch.Tensor, list[int]]:
    """Prefill positions of the two prompts back to back, and each prompt's offset for generated tokens."""
    if config.mrope_section is None:
        return torch.cat([torch.arange(len(p)) for p in prompts]), [0, 0]
    from engine.inputs.mrope import get_mrope_positions

    parts, deltas = [], []
    for i, p in enumerate(prompts):
        grids = [GRID] if image and i == 0 else []
        pos, delta = get_mrope_positions(p, grids, config.image_token_id, config.vision.spatial_merge_size)
        parts.append(pos)
        deltas.append(delta)
    return torch.cat(parts, dim=1), deltas


@torch.inference_mode()
def model_logits(model_dir: str, image: bool = False, load_format: str = "auto",
                 config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Logits of a prefill of two prompts (one with an image when `image`) and of one decode step after it."""
    from engine.model.decoder import MultimodalEmbeds

    config = config or load_model_config(model_dir)
    model = build_model(config, 256, torch.float32, CPU)
    load_weights(model, model_dir, load_format, CPU)
    caches = CacheEngine(config, 4, 0, BLOCK, torch.float32, CPU).layer_caches()
    prompts, img = _prompts(config, image)
    ids = torch.tensor(prompts[0] + prompts[1])
    positions, deltas = _positions(config, prompts, image)
    mm = None
    if img is not None:
        embeds, deepstack = model.encode_images(img["pixels"], img["grid"])
        mm = MultimodalEmbeds((ids == config.image_token_id).nonzero()[:, 0], embeds, deepstack)
    lens = [len(p) for p in prompts]
    hidden = model(ids, positions, caches, _metadata([0, 0], lens, 0), mm)
    prefill = model.compute_logits(hidden)
    decode_pos = torch.tensor([lens[0] + deltas[0], lens[1] + deltas[1]])
    if config.mrope_section is not None:
        decode_pos = decode_pos.expand(3, -1)
    hidden = model(torch.tensor([5, 9]), decode_pos, caches, _metadata(lens, [1, 1], 2))
    return {"prefill": prefill, "decode": model.compute_logits(hidden),
            "kv_heads": caches[0][0].shape[2], "q_heads": model.decoder.layers[0].self_attn.num_heads}


def many_logits(cases: list[tuple]) -> list:
    """model_logits for each case; a ModelLoadError comes back as its message (a refusal is a result)."""
    out = []
    for case in cases:
        try:
            out.append(model_logits(*case))
        except ModelLoadError as e:
            out.append(f"ModelLoadError[{e.code}]: {e.message}")
    return out


# ---- the comparisons ---------------------------------------------------------------------------------------------
def assert_same_logits(sharded: dict, whole: dict, what: str, atol: float = 2e-5) -> None:
    for key in ("prefill", "decode"):
        assert sharded[key].shape == whole[key].shape, f"{what}: {key} logits shape"
        torch.testing.assert_close(sharded[key], whole[key], atol=atol, rtol=1e-5,
                                   msg=lambda m: f"{what}, {key} logits: {m}")


QUANT_SPECS = {   # layouts that split at TP=2 on the tiny Qwen3 (hidden 64, 4 heads of 16, 2 KV heads, mlp 128)
    "awq group 32": Spec("awq", group_size=32, symmetric=False),
    "gptq 8-bit group 16": Spec("gptq", bits=8, group_size=16),
    "gptq 4-bit per-channel asymmetric": Spec("gptq", group_size=-1, symmetric=False),
    "compressed-tensors 4-bit group 16 asymmetric": Spec("compressed-tensors", group_size=16, symmetric=False),
    "compressed-tensors 8-bit per-channel": Spec("compressed-tensors", bits=8, group_size=-1),
    "fp8 16x32 blocks": Spec("fp8", block_size=(16, 32)),
    "fp8 128x32 blocks (ranks start inside a block)": Spec("fp8", block_size=(128, 32)),
}
REFUSED_SPECS = {   # (spec, what the refusal names)
    "gptq act-order": (Spec("gptq", group_size=32, act_order=True),
                       r"o_proj: act-order .* cannot split .* tensor_parallel_size 2"),
    "awq group 64 > o_proj's 32 inputs per rank": (Spec("awq", group_size=64, symmetric=False),
                                                   r"o_proj: this rank's input size 32 .* group size 64 .* "
                                                   r"tensor_parallel_size 2"),
    "fp8 128x128 blocks": (Spec("fp8", block_size=(128, 128)),
                           r"o_proj: this rank's input size 32 is not a multiple of the fp8 block width 128"),
}


@pytest.fixture(scope="module")
def llama_bias_dir(tmp_path_factory) -> Path:
    """Llama with attention_bias: q/k/v biases split with their heads, o_proj's added once after the all-reduce."""
    import tiny_models

    return tiny_models.build_llama(tmp_path_factory.mktemp("models") / "tiny-llama-bias", attention_bias=True)


@pytest.fixture(scope="module")
def quantized_dirs(qwen3_dir, qwen3_vl_dir, tmp_path_factory) -> dict[str, Path]:
    dirs = {name: write_quantized(qwen3_dir, tmp_path_factory.mktemp("tp-quant"), spec)[0]
            for name, spec in {**QUANT_SPECS, **{n: s for n, (s, _) in REFUSED_SPECS.items()}}.items()}
    dirs["vl fp8 with vision blocks"] = write_quantized(
        qwen3_vl_dir, tmp_path_factory.mktemp("tp-quant"), Spec("fp8", block_size=(16, 32), quantize_vision=True))[0]
    return dirs


def test_attention_biases_load_and_match_transformers(llama_bias_dir):
    from oracle import hf_model

    ours = model_logits(str(llama_bias_dir))
    prompts, _ = _prompts(load_model_config(llama_bias_dir), image=False)
    with torch.inference_mode():
        ref = hf_model(str(llama_bias_dir))(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(ours["prefill"][:len(prompts[0])], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tp2_logits_equal_tp1_for_every_model_and_weight_format(llama_dir, llama_bias_dir, qwen3_dir, qwen3_vl_dir,
                                                                quantized_dirs):
    cases = {"llama": (str(llama_dir),), "llama with attention biases": (str(llama_bias_dir),),
             "qwen3": (str(qwen3_dir),), "qwen3-vl text": (str(qwen3_vl_dir),),
             "qwen3-vl image": (str(qwen3_vl_dir), True),
             **{name: (str(d),) for name, d in quantized_dirs.items() if name not in REFUSED_SPECS},
             "qwen3-vl fp8 image": (str(quantized_dirs["vl fp8 with vision blocks"]), True)}
    cases.pop("vl fp8 with vision blocks")
    refused = {name: (str(quantized_dirs[name]),) for name in REFUSED_SPECS}
    dummy = [(str(qwen3_dir), False, "dummy"), (str(quantized_dirs["awq group 32"]), False, "dummy")]
    ranks = run_tensor_parallel(many_logits, 2, list(cases.values()) + list(refused.values()) + dummy,
                                timeout_s=240)
    whole = many_logits(list(cases.values()))
    for a, b in zip(*ranks):   # compute_logits hands every rank the same full logits
        if not isinstance(a, str):
            assert torch.equal(a["prefill"], b["prefill"]) and torch.equal(a["decode"], b["decode"])
    for name, result in zip(["float", "awq"], ranks[0][-len(dummy):]):
        assert torch.isfinite(result["prefill"]).all() and torch.isfinite(result["decode"]).all(), f"dummy {name}"
    for rank, results in enumerate(ranks):
        for name, sharded, ref in zip(cases, results, whole):
            assert not isinstance(sharded, str), f"{name} at TP=2: {sharded}"
            assert_same_logits(sharded, ref, f"{name}, rank {rank} of 2")
            assert sharded["q_heads"] * 2 == ref["q_heads"] and sharded["kv_heads"] * 2 == ref["kv_heads"]
        for name, message in zip(refused, results[len(cases):]):
            assert isinstance(message, str) and message.startswith("ModelLoadError[tensor_parallel]"), (name, message)
            assert __import__("re").search(REFUSED_SPECS[name][1], message), (name, message)


@pytest.mark.slow
def test_tp4_replicates_kv_heads_and_equals_tp1(qwen3_dir, qwen3_vl_dir, quantized_dirs):
    """4 ranks, 2 KV heads: each KV head is held by the two ranks whose q heads read it (its quantized zero
    points too)."""
    cases = [(str(qwen3_dir),), (str(qwen3_vl_dir), True),
             (str(quantized_dirs["compressed-tensors 4-bit group 16 asymmetric"]),)]
    ranks = run_tensor_parallel(many_logits, 4, cases, timeout_s=240)
    whole = many_logits(cases)
    for rank, results in enumerate(ranks):
        for case, sharded, ref in zip(cases, results, whole):
            assert not isinstance(sharded, str), sharded
            assert_same_logits(sharded, ref, f"{case}, rank {rank} of 4")
            assert (sharded["q_heads"], sharded["kv_heads"]) == (1, 1)


@pytest.mark.slow
def test_tp3_gguf_equals_tp1_and_a_model_whose_heads_do_not_split_is_refused_on_every_rank(smollm2_gguf, qwen3_dir):
    """SmolLM2-135M (9 heads, 3 KV heads, Q4_1/Q8_0 GGUF, 30 layers): each rank dequantizes only its part."""
    config = load_model_config(smollm2_gguf)   # read once: transformers' GGUF metadata reader takes seconds
    cases = [(str(smollm2_gguf), False, "auto", config), (str(qwen3_dir),)]
    ranks = run_tensor_parallel(many_logits, 3, cases, timeout_s=300)
    [whole] = many_logits(cases[:1])
    for rank, (sharded, refused) in enumerate(ranks):
        assert not isinstance(sharded, str), sharded
        # Logits of about 20 after 30 layers: fp32 sums in another order differ by up to ~1e-4.
        assert_same_logits(sharded, whole, f"SmolLM2 GGUF, rank {rank} of 3", atol=3e-4)
        assert (sharded["q_heads"], sharded["kv_heads"]) == (3, 1)
        assert refused == ("ModelLoadError[tensor_parallel]: tensor_parallel_size 3 does not fit this model: it does "
                           "not divide the 4 attention heads; it neither divides the 2 key-value heads nor is a "
                           "multiple of them; it does not divide intermediate_size 128 (sizes that fit: 1, 2, 4)")


def test_a_size_the_heads_cannot_split_is_refused_with_the_sizes_that_fit(qwen3_dir, llama_dir):
    qwen3, llama = load_model_config(qwen3_dir), load_model_config(llama_dir)   # 4 heads / 2 KV; 6 heads / 2 KV
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size 3 does not fit this model: it does not divide "
                                             r"the 4 attention heads; .* 2 key-value heads .*sizes that fit: 1, 2, 4"):
        qwen3.verify_tensor_parallel(3)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size 4 .* 6 attention heads .*sizes that fit: 1, 2, 6\)"):
        llama.verify_tensor_parallel(4)
    with pytest.raises(ModelLoadError) as err:
        qwen3.verify_tensor_parallel(0)
    assert err.value.code == "tensor_parallel"
    assert qwen3.kv_heads_per_rank(1) == 2 and qwen3.kv_heads_per_rank(2) == 1 and qwen3.kv_heads_per_rank(4) == 1


def fail_on_rank_1() -> None:
    """Rank 1 fails while rank 0 waits in a collective for it (what a model bug on one rank looks like)."""
    from engine.distributed.parallel_state import get_tp_rank, tensor_model_parallel_all_reduce

    if get_tp_rank() == 1:
        raise ValueError("boom on rank 1")
    tensor_model_parallel_all_reduce(torch.ones(1))


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_at_once_and_no_rank_is_left_behind():
    import multiprocessing
    import time

    from tp_helpers import RankError

    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed:.*ValueError: boom on rank 1"):
        run_tensor_parallel(fail_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 60, "the failure ends the run, not the timeout"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank-")]
