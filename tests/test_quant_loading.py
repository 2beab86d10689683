"""Quantized checkpoints that cannot run exactly are refused at load with an error naming what is unsupported;
--quantization states the method (and must agree with the checkpoint) or picks the layout of dummy weights; the
test packers agree with the compressed-tensors library's reading of the format."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.args import EngineArgs
from engine.errors import ModelLoadError
from engine.model.quantization.config import QuantizationConfig, WNA16Scheme
from engine.model.linear import QKVParallelLinear
from engine.model.quantization.layers import Fp8BlockLinearMethod, WNA16LinearMethod
from engine.model.quantization.parse import parse_quantization_config
from engine_helpers import make_llm
from quant_checkpoints import Spec, build_qwen3_wide, compressed_tensors_tensors, quantization_config, write_quantized

CT_W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def ct(weights=None, **group) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights or CT_W4, **group}}}


REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes'"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    "awq 3-bit": ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "awq with 3-bit"),
    "gptq 3-bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3-bit"),
    "gptq 2-bit": ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "gptq with 2-bit"),
    "gptq v2 format": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"},
                       "checkpoint_format 'gptq_v2'"),
    "gptq marlin format": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
                           "checkpoint_format 'marlin'"),
    "fp8 per-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "per-tensor scales"),
    "compressed-tensors W8A8 int": (ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                       input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                                          "dynamic": True}), "W8A8"),
    "compressed-tensors float8": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                       "num_bits": 8, "type": "float", "strategy": "channel"}}}},
                                  "format 'float-quantized'"),
    "compressed-tensors int-quantized": ({**ct(), "format": "int-quantized"}, "format 'int-quantized'"),
    "compressed-tensors per-tensor": (ct({**CT_W4, "strategy": "tensor"}), "weight strategy 'tensor'"),
    "compressed-tensors 2-bit": (ct({**CT_W4, "num_bits": 2}), "2-bit"),
    "compressed-tensors kv cache": ({**ct(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
                                    "kv_cache_scheme"),
    "fp8 kv cache": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
                     "fp8 with a quantized KV cache .kv_cache_scheme.: KV cache scales are not supported"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_layouts_are_refused_by_name(name):
    qc, message = REFUSED[name]
    with pytest.raises(ModelLoadError, match="unsupported quantized checkpoint: .*" + message.replace("(", r"\(")):
        parse_quantization_config(qc)


def test_refused_at_engine_start_with_a_clear_error(qwen3_dir, tmp_path):
    quant_dir, _ = write_quantized(qwen3_dir, tmp_path, Spec("awq", group_size=32, symmetric=False))
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="awq version 'gemv'"):
        make_llm(quant_dir)


@pytest.fixture(scope="module")
def awq_dir(qwen3_dir, tmp_path_factory):
    return write_quantized(qwen3_dir, tmp_path_factory.mktemp("awq"), Spec("awq", group_size=32,
                                                                           symmetric=False))[0]


def test_quantization_flag_must_agree_with_the_checkpoint(awq_dir, qwen3_dir):
    with pytest.raises(ModelLoadError, match="--quantization gptq contradicts the checkpoint.*awq"):
        make_llm(awq_dir, quantization="gptq")
    assert make_llm(awq_dir, quantization="awq_marlin").engine.model_config.quantization.method == "awq"
    with pytest.raises(ModelLoadError, match="has no quantization_config"):
        make_llm(qwen3_dir, quantization="fp8")
    with pytest.raises(ValueError, match="quantization method 'nf4'"):
        EngineArgs(model=str(qwen3_dir), quantization="nf4")


def test_a_missing_quantized_tensor_is_named(awq_dir, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(awq_dir, broken)
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.qzeros"]
    save_file(state, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.qzeros"):
        make_llm(broken)


def test_act_order_weights_under_a_config_without_desc_act_are_refused(qwen3_dir, tmp_path):
    quant_dir, _ = write_quantized(qwen3_dir, tmp_path, Spec("gptq", group_size=32, act_order=True))
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="activation order .* desc_act"):
        make_llm(quant_dir)


def test_a_fused_layer_with_some_shards_ignored_is_refused():
    quant = QuantizationConfig("compressed-tensors", [(["Linear"], WNA16Scheme(4, 32, True))],
                               ignore=["model.layers.0.self_attn.k_proj"])
    with pytest.raises(ModelLoadError, match="quantizes .*q_proj.*k_proj.* differently"):
        QKVParallelLinear(64, 16, 4, 2, False, quant, [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])


def test_ignore_patterns():
    quant = parse_quantization_config(quantization_config(
        Spec("compressed-tensors", skip=[r".*layers\.1\.mlp\."]), [], multimodal=True))
    assert quant.scheme_for("model.language_model.layers.0.mlp.down_proj") is not None
    assert quant.scheme_for("model.language_model.layers.1.mlp.down_proj") is None
    assert quant.scheme_for("model.visual.blocks.0.attn.qkv") is None
    assert quant.scheme_for("lm_head") is None
    awq = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                     "modules_to_not_convert": ["visual", "layers.2.mlp"]})
    assert awq.scheme_for("model.visual.blocks.0.attn.qkv") is None
    assert awq.scheme_for("model.language_model.layers.2.mlp.up_proj") is None
    assert awq.scheme_for("model.language_model.layers.0.mlp.up_proj") == WNA16Scheme(4, 128, False)


# ---- the compressed-tensors library as an independent reader of the test packer ------------------------------
@pytest.mark.parametrize("spec", [Spec("compressed-tensors", bits=4, group_size=32, symmetric=False),
                                  Spec("compressed-tensors", bits=8, group_size=-1)],
                         ids=["w4 g32 asym", "w8 channel"])
def test_compressed_tensors_library_reads_the_test_checkpoints_as_written(spec):
    ct_lib = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = ct_lib.QuantizationConfig.model_validate(quantization_config(spec, [], multimodal=False))
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.1
    tensors, dequantized = compressed_tensors_tensors(w, spec, torch.Generator().manual_seed(1))
    scheme = QuantizationScheme.model_validate(qc.config_groups["group_0"].model_dump())
    out = PackedQuantizationCompressor.decompress(dict(tensors), scheme)
    # The library multiplies in the scale's dtype (bf16): one rounding of the same exact product.
    assert out["weight"].dtype == torch.bfloat16
    torch.testing.assert_close(out["weight"], dequantized.to(torch.bfloat16), atol=0, rtol=0)


# ---- random weights in each format (benchmarks) --------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_wide_dir(tmp_path_factory):
    return build_qwen3_wide(tmp_path_factory.mktemp("models") / "tiny-qwen3-wide")


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq", "compressed-tensors"])
def test_dummy_weights_in_each_format(qwen3_wide_dir, method):
    llm = make_llm(qwen3_wide_dir, load_format="dummy", quantization=method)
    proj = llm.engine.model_executor.driver_worker.model.decoder.layers[0].self_attn.qkv_proj
    assert isinstance(proj.quant_method, Fp8BlockLinearMethod if method == "fp8" else WNA16LinearMethod)
    [out] = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    logits = llm.engine.model_executor.driver_worker.model.compute_logits(torch.zeros(1, 128))
    assert torch.isfinite(logits).all()


def test_a_layers_tensors_split_across_shard_files_load_as_one(awq_dir, tmp_path):
    """qweight in one file, qzeros and scales in another (as sharded checkpoints split them)."""
    import shutil
    sharded = tmp_path / "sharded"
    shutil.copytree(awq_dir, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(awq_dir / "model.safetensors")
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, tensor in state.items():
        files[sorted(files)[name.endswith((".qzeros", ".scales"))]][name] = tensor
    for file, tensors in files.items():
        save_file(tensors, sharded / file)
    index = {"metadata": {}, "weight_map": {n: f for f, ts in files.items() for n in ts}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [want] = make_llm(awq_dir).generate("The capital of France is", greedy)
    [got] = make_llm(sharded).generate("The capital of France is", greedy)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_fp8_weights_without_a_quantization_config_are_refused(qwen3_dir, tmp_path):
    """Loaded as plain weights (no scales), an fp8 checkpoint would answer garbage: it is refused instead."""
    quant_dir, _ = write_quantized(qwen3_dir, tmp_path, Spec("fp8", block_size=(32, 32)))
    config = json.loads((quant_dir / "config.json").read_text())
    del config["quantization_config"]
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError,
                       match=r"model\.layers\.0\..*\.weight is float8_e4m3fn .* no fp8 quantization_config"):
        make_llm(quant_dir)
