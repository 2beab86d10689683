"""The launcher fits the engine's flags to the GPU (app/fit.py), as llama.cpp's --fit does: on a card where the
engine's defaults leave no KV room it adds flags, cheapest first, until the KV pool holds a target context; where
the defaults fit, without a GPU, or when told not to, it adds nothing; the user's flags are never changed. The
README's "Flags per card" table is this function's output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.checkpoints import BF16, GB, GiB, WeightFormat, weight_bytes
from app.fit import IMAGE_CAP_PIXELS, MIN_CONTEXT, ROOMY_CONTEXT, TARGET_CONTEXT, fit, fit_for_launch, user_settings
from app.memory_estimate import (LIMIT_SLACK_BYTES, NON_TORCH_BYTES, EngineSettings, estimate, graph_pools)
from app.fit_table import HUB_BEGIN, HUB_END, hub_table, readme_table, reference_shape, table
from app.launcher import fit_engine_flags
from app.models import ResolvedModel

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO / "bench" / "model_configs" / "qwen3-vl-8b-instruct"
CONFIG = json.loads((REFERENCE_DIR / "config.json").read_text())
SHAPE = reference_shape()
INT4, FP8 = WeightFormat("int4 g128", 4, 128), WeightFormat("fp8", 8, block=(128, 128))
W4, W8, W16 = (weight_bytes(CONFIG, f) for f in (INT4, FP8, BF16))
SHAPE4 = SHAPE.with_format(INT4)          # integer weights: prefill-sized steps dequantize a layer at a time
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": ["visual"]}


def nothing_used(env) -> None:
    """What other processes hold on the card: nothing (the tests do not read this machine's nvidia-smi)."""
    return None


def card(gib: float) -> int:
    return int(gib * GiB)


def flags_of(plan) -> dict[str, str | None]:
    return {f.args[0]: (f.args[1] if len(f.args) > 1 else None) for f in plan.flags}


# ---- the memory sum ------------------------------------------------------------------------------------------
def test_the_sum_uses_the_readmes_figures():
    assert SHAPE.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2 == 144 * 1024       # 144 KiB per token
    assert 16384 * SHAPE.encoder_bytes_per_token == 16384 * 4 * 4096 * 2          # the default encoder cache
    assert SHAPE.embedding_bytes == 151936 * 4096 * 2
    e = estimate(card(24), W16, SHAPE, EngineSettings())
    assert e.usable == int(0.9 * card(24))                                        # gpu_memory_utilization
    assert e.decoder_peak == int(0.9 * GB)                                        # 8192 batched tokens
    assert e.weights == W16 + 262144 * 128 * 4                                    # + the rotary tables
    assert e.kv_bytes == e.usable - e.weights - NON_TORCH_BYTES - e.activation_peak
    assert e.graphs and e.pool_tokens == e.kv_bytes // (16 * SHAPE.kv_bytes_per_token) * 16 - 4096


def test_the_sum_takes_the_engines_sizing_rules_from_the_engine():
    """One implementation: the launcher imports the engine's torch-free sizing rules (engine/sizing.py), which
    the engine's memory code uses too."""
    import app.memory_estimate as est
    import engine.sizing
    import engine.worker.vision_graphs
    assert est.batch_size_ladder is engine.sizing.batch_size_ladder
    assert est.scratch_blocks_needed is engine.sizing.scratch_blocks_needed
    assert est.LIMIT_SLACK_BYTES is engine.sizing.LIMIT_SLACK_BYTES
    assert est.MAX_GRAPH_PATCHES is engine.worker.vision_graphs.MAX_GRAPH_PATCHES is engine.sizing.MAX_GRAPH_PATCHES
    assert est.GRAPH_PREFILL_TOKENS == engine.sizing.PREFILL_BUCKETS[-1]


def test_the_graph_code_captures_the_shapes_the_sizing_rules_name():
    """The CUDA graphs and the KV sizing take their shapes from engine/sizing.py, as the launcher does."""
    import engine.sizing
    import engine.worker.cuda_graphs as graphs
    import engine.worker.kv_sizing as kv_sizing
    import engine.worker.worker as worker
    assert graphs.PREFILL_BUCKETS is engine.sizing.PREFILL_BUCKETS
    assert graphs.batch_size_ladder is engine.sizing.batch_size_ladder
    assert worker.prefill_scratch_blocks is kv_sizing.prefill_scratch_blocks is engine.sizing.prefill_scratch_blocks
    assert worker.scratch_blocks_needed is engine.sizing.scratch_blocks_needed
    assert kv_sizing.LIMIT_SLACK_BYTES is engine.sizing.LIMIT_SLACK_BYTES


def test_the_image_cap_is_read_where_and_as_the_engine_reads_it(qwen3_vl_dir, qwen3_vl_transformers5_dir, tmp_path):
    """preprocessor_config.json, or transformers 5's processor_config.json: the largest image the sum profiles is
    the one the engine's image processor lets through."""
    from engine.inputs.image_processor import ImageProcessor
    from app.memory_estimate import ModelShape
    capped = tmp_path / "capped"
    capped.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (capped / name).write_text((qwen3_vl_dir / name).read_text())
    pre = json.loads((capped / "preprocessor_config.json").read_text())
    (capped / "preprocessor_config.json").write_text(json.dumps({**pre, "max_pixels": 1 << 20}))
    for model in (qwen3_vl_dir, qwen3_vl_transformers5_dir, capped):
        assert ModelShape.from_model_dir(model).max_pixels == ImageProcessor.from_model_dir(model).max_pixels
    assert ModelShape.from_model_dir(capped).max_pixels == 1 << 20


def test_the_settings_default_to_the_engines_flags():
    from engine.args import EngineArgs
    s, args = EngineSettings(), EngineArgs(model="m")
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.encoder_cache_size, s.block_size, s.kv_cache_dtype) == (
        args.batched_tokens_budget, args.max_num_seqs, args.encoder_cache_size, args.block_size,
        args.kv_cache_dtype)
    assert (s.gpu_memory_utilization, s.gpu_memory_limit, s.enforce_eager, s.cpu_embeddings) == (
        args.gpu_memory_utilization, args.gpu_memory_limit, args.enforce_eager, args.cpu_embeddings)


def test_the_dequantizing_step_size_is_the_engines():
    pytest.importorskip("triton")
    from engine.ops.triton.quant.table import WNA16_DEQUANT_ABOVE
    import app.memory_estimate as est
    assert est.DEQUANT_ABOVE_TOKENS == WNA16_DEQUANT_ABOVE


def test_under_a_memory_limit_the_graphs_and_the_encoder_cache_come_out_of_it():
    """...and the step's three phases add up: under a limit the engine profiles the allocator's reserved peak,
    where each phase's freed blocks stay reserved while the next allocates."""
    settings = EngineSettings(gpu_memory_limit=16, max_pixels=IMAGE_CAP_PIXELS)
    e = estimate(card(141), W4, SHAPE4, settings)
    assert e.usable == card(16)
    assert e.activation_peak == e.decoder_peak + e.sampler_peak + e.vision_peak
    pools = graph_pools(SHAPE4, settings, e.max_len, prefill=True)
    assert e.kv_bytes == (card(16) - e.weights - NON_TORCH_BYTES - e.activation_peak - pools - e.encoder_cache
                          - LIMIT_SLACK_BYTES)
    assert e.prefill_graphs
    idle = estimate(card(12), W4, SHAPE4, EngineSettings())
    assert idle.activation_peak == max(idle.decoder_peak, idle.sampler_peak, idle.vision_peak)


def test_under_a_limit_a_pool_too_small_for_the_prefill_graphs_sets_aside_the_decode_graphs_alone():
    """As the engine does (engine/worker/kv_sizing.py): where the prefill graphs' pool would leave 8192 tokens or fewer,
    only the decode graphs' (much smaller) pool comes out of the limit, and the prefill graphs are left out."""
    flags = ["--mm-processor-kwargs", '{"max_pixels": 1048576}', "--cpu-embeddings", "--kv-cache-dtype", "fp8",
             "--max-num-batched-tokens", "1024", "--max-num-seqs", "16", "--encoder-cache-size", "1024",
             "--max-model-len", "8192"]
    roomy = estimate(card(141), W4, SHAPE4, user_settings(["--gpu-memory-limit", "8.75", *flags])[0])
    tight = estimate(card(141), W4, SHAPE4, user_settings(["--gpu-memory-limit", "7.875", *flags])[0])
    assert roomy.prefill_graphs and not tight.prefill_graphs and tight.graphs
    settings = user_settings(flags)[0]
    decode_only = graph_pools(SHAPE4, settings, 8192, prefill=False)
    assert decode_only < graph_pools(SHAPE4, settings, 8192, prefill=True) // 4
    assert tight.kv_bytes == (card(7.875) - tight.weights - NON_TORCH_BYTES - tight.activation_peak - decode_only
                              - tight.encoder_cache - LIMIT_SLACK_BYTES)
    assert tight.pool_tokens > roomy.pool_tokens       # no scratch blocks, a smaller graph pool
    # A little more room: the decode graphs' pool alone leaves more than twice the scratch, and still the prefill
    # graphs stay out (the engine decided on the pool with theirs), so no scratch comes off the pool.
    wider = estimate(card(141), W4, SHAPE4, user_settings(["--gpu-memory-limit", "8", *flags])[0])
    blocks = wider.kv_bytes // (wider.kv_bytes_per_token * 16)
    assert blocks > 2 * 256 and not wider.prefill_graphs and wider.pool_tokens == blocks * 16


def test_the_sum_matches_the_h200_profiles_logged_under_a_limit():
    """bench/results/h200_memcaps_{fp816,awq8}_5c5d2ba.json: the engine's logged memory profile under
    --gpu-memory-limit with the flags of that run (before the allocator slack existed: it is added back here).
    The 4-bit KV pool is 3% over the log's: the sum counts 0.03 GB less weight than the engine held (6.12 GB)."""
    fp8 = "--max-model-len 23552 --mm-processor-kwargs {\"max_pixels\":1048576} --cpu-embeddings"
    e = estimate(card(141), W8, SHAPE, user_settings(["--gpu-memory-limit", "16", *fp8.split(" ")])[0])
    assert e.activation_peak / GB == pytest.approx(2.37, rel=0.01)          # "activation peak 2.37 GB"
    graphs = graph_pools(SHAPE, user_settings(fp8.split(" "))[0], 23552, prefill=True)
    assert (graphs + e.encoder_cache) / GB == pytest.approx(1.36, rel=0.01)  # "CUDA graphs + encoder cache 1.36 GB"
    assert (e.kv_bytes + LIMIT_SLACK_BYTES) / GB == pytest.approx(3.35, rel=0.01)   # "KV cache 3.35 GB"
    awq = ("--max-model-len 9216 --mm-processor-kwargs {\"max_pixels\":1048576} --cpu-embeddings --kv-cache-dtype fp8 "
           "--max-num-batched-tokens 1024 --max-num-seqs 16 --encoder-cache-size 4096 --enforce-eager")
    e = estimate(card(141), W4, SHAPE4, user_settings(["--gpu-memory-limit", "8", *awq.split(" ")])[0])
    assert e.activation_peak / GB == pytest.approx(0.56, rel=0.02)          # "activation peak 0.56 GB"
    assert (e.kv_bytes + LIMIT_SLACK_BYTES) / GB == pytest.approx(1.05, rel=0.04)   # "KV cache 1.05 GB"


def test_integer_weights_add_a_dequantized_layer_to_prefill_sized_steps():
    """AWQ, GPTQ and compressed-tensors int steps of more than 64 tokens dequantize each linear layer whole
    before cuBLAS multiplies: the largest (gate_up, 4096 x 24576 in bf16: 192 MiB) is live in the step."""
    assert SHAPE4.dequant_bytes(8192) == 4096 * 2 * 12288 * 2 == 192 << 20
    assert SHAPE4.dequant_bytes(64) == 0 and SHAPE.dequant_bytes(8192) == 0
    assert SHAPE.with_format(FP8).dequant_bytes(8192) == 0                   # FP8 tensor cores read FP8
    small = EngineSettings(max_num_batched_tokens=1024, max_num_seqs=16)
    assert estimate(card(8), W4, SHAPE4, small).decoder_peak == \
        estimate(card(8), W4, SHAPE, small).decoder_peak + (192 << 20)


def test_smaller_images_steps_and_embeddings_in_host_memory_each_free_memory():
    base = estimate(card(12), W4, SHAPE4, EngineSettings())
    for change in ({"max_pixels": IMAGE_CAP_PIXELS}, {"cpu_embeddings": True},
                   {"max_num_batched_tokens": 1024, "max_num_seqs": 16, "max_pixels": IMAGE_CAP_PIXELS}):
        assert estimate(card(12), W4, SHAPE4, EngineSettings(**change)).kv_bytes > base.kv_bytes, change


# ---- the plans -----------------------------------------------------------------------------------------------
def test_an_8_gib_card_with_a_4_bit_checkpoint_gets_at_least_4096_tokens():
    plan = fit(card(8), W4, SHAPE4)
    assert plan.fits and plan.estimate.context >= MIN_CONTEXT and plan.estimate.pool_tokens >= MIN_CONTEXT
    flags = flags_of(plan)
    assert json.loads(flags["--mm-processor-kwargs"]) == {"max_pixels": 1024 * 1024}
    assert "--cpu-embeddings" in flags
    assert int(flags["--max-model-len"]) == plan.estimate.context <= plan.estimate.pool_tokens
    assert all(f.reason for f in plan.flags)


def test_without_defaults_that_fit_the_cheapest_steps_come_first():
    """A 16 GiB card with FP8 needs only smaller worst-case images (and takes the embeddings to host memory for
    a roomier context); a 12 GiB card goes further down the list."""
    assert set(flags_of(fit(card(16), W8, SHAPE))) == {"--mm-processor-kwargs", "--cpu-embeddings", "--max-model-len"}
    twelve = fit(card(12), W8, SHAPE)
    assert twelve.fits and twelve.estimate.context >= TARGET_CONTEXT
    flags = list(flags_of(twelve))
    # The fp8 KV cache comes after the embeddings in host memory and before smaller steps; it doubles the pool,
    # so the CUDA graphs stay.
    assert flags.index("--cpu-embeddings") < flags.index("--kv-cache-dtype") < flags.index("--max-num-batched-tokens")
    assert flags_of(twelve)["--kv-cache-dtype"] == "fp8" and "--enforce-eager" not in flags
    eight = fit(card(8), W4, SHAPE4)
    assert eight.fits and "--enforce-eager" not in flags_of(eight)    # the minimum context fits with CUDA graphs


def test_a_pool_too_small_for_the_prefill_graphs_keeps_the_decode_graphs():
    """The prefill graphs' 4096 tokens of scratch blocks are dropped from a pool of 8192 tokens or fewer, and the
    decode graphs stay (engine/worker/cuda_graphs.py): on an 8 GiB card no --enforce-eager; eager decode steps are ~10x
    slower. Under a limit, where the graph pools come out of the limit too, no CUDA graphs is the last resort for
    the minimum context."""
    eight = fit(card(8), W4, SHAPE4)
    assert eight.fits and MIN_CONTEXT <= eight.estimate.context < TARGET_CONTEXT
    assert eight.estimate.graphs and not eight.estimate.prefill_graphs and "--enforce-eager" not in eight.args()
    assert eight.estimate.pool_tokens * eight.estimate.kv_bytes_per_token <= eight.estimate.kv_bytes
    eager = fit(card(141), W4, SHAPE4, ["--gpu-memory-limit", "7.5"])
    assert list(flags_of(eager))[-1] == "--enforce-eager" and eager.fits      # the last resort, last in the list
    assert eager.estimate.context >= MIN_CONTEXT and not eager.estimate.graphs


def test_an_fp8_kv_cache_holds_twice_the_tokens_in_the_same_bytes():
    assert SHAPE.kv_bytes_per_token_as("fp8") == SHAPE.kv_bytes_per_token_as("fp8_e4m3") == 72 * 1024
    settings = EngineSettings(enforce_eager=True)      # no graph scratch blocks: the pools compare directly
    bf16 = estimate(card(24), W8, SHAPE, settings)
    fp8 = estimate(card(24), W8, SHAPE, EngineSettings(enforce_eager=True, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes == bf16.kv_bytes and fp8.pool_tokens in (2 * bf16.pool_tokens, 2 * bf16.pool_tokens + 16)
    reason = {f.args[0]: f.reason for f in fit(card(12), W8, SHAPE).flags}["--kv-cache-dtype"]
    assert "72 KiB per token instead of 144" in reason and "accuracy" in reason


def test_the_fp8_kv_cache_gives_an_8_gib_card_more_context():
    plan = fit(card(8), W4, SHAPE4)
    assert flags_of(plan)["--kv-cache-dtype"] == "fp8" and plan.estimate.context >= MIN_CONTEXT
    kept = fit(card(8), W4, SHAPE4, ["--kv-cache-dtype", "auto"])     # the user's choice stands
    assert "--kv-cache-dtype" not in kept.args() and kept.estimate.context < plan.estimate.context


def test_once_at_work_the_fit_also_takes_the_free_step_for_a_roomier_context():
    """Where the other steps reach the target short of ROOMY_CONTEXT, the embeddings go to host memory too when
    that gives more context; without that step the 16 GiB FP8 card stops below 16k tokens."""
    roomy = fit(card(16), W8, SHAPE)
    assert flags_of(roomy).get("--cpu-embeddings", "") is None and roomy.estimate.context >= ROOMY_CONTEXT
    without = fit(card(16), W8, SHAPE, ["--max-model-len", "8192"])      # the user's length: no room to gain
    assert "--cpu-embeddings" not in without.args()
    assert "--cpu-embeddings" not in fit(card(24), W16, SHAPE).args()     # the defaults fit: nothing is added


@pytest.mark.parametrize("gib, weights, shape", [(24, W16, SHAPE), (24, W8, SHAPE), (16, W4, SHAPE4)])
def test_where_the_defaults_fit_nothing_is_added(gib, weights, shape):
    plan = fit(card(gib), weights, shape)
    assert plan.flags == () and plan.args() == [] and "defaults fit" in plan.summary
    assert plan.estimate.pool_tokens >= TARGET_CONTEXT


def test_weights_that_cannot_fit_are_said_so():
    plan = fit(card(8), W16, SHAPE)
    assert not plan.fits and "does not fit" in plan.summary and "smaller checkpoint" in plan.summary


def test_a_tied_embedding_model_never_gets_cpu_embeddings():
    from dataclasses import replace
    tied = replace(SHAPE4, tied=True)
    plan = fit(card(8), W4 - SHAPE.embedding_bytes, tied)     # lm_head is the embedding table: nothing to move
    assert "--cpu-embeddings" not in plan.args() and len(plan.flags) > 2


# ---- the user's flags ----------------------------------------------------------------------------------------
USER = ["--max-num-batched-tokens", "4096", "--max-num-seqs=128", "--mm-processor-kwargs", '{"min_pixels": 3136}',
        "--enforce-eager"]


def test_the_users_flags_are_read_in_both_forms():
    settings, given, skip = user_settings(USER + ["--gpu-memory-limit", "10GiB"])
    assert (settings.max_num_batched_tokens, settings.max_num_seqs, settings.enforce_eager) == (4096, 128, True)
    assert settings.max_pixels is None and settings.gpu_memory_limit == 10 and skip is None
    assert given == {"max_num_batched_tokens", "max_num_seqs", "max_pixels", "enforce_eager", "gpu_memory_limit"}


def test_flags_the_user_gave_are_never_overridden():
    plan = fit(card(8), W4, SHAPE4, USER)
    added = set(flags_of(plan))
    assert not added & {"--max-num-batched-tokens", "--max-num-seqs", "--mm-processor-kwargs", "--enforce-eager"}
    assert "--cpu-embeddings" in added                                 # the steps the user left open
    own = fit(card(8), W4, SHAPE4, ["--max-model-len", "2048"])
    assert "--max-model-len" not in own.args() and own.estimate.max_len == 2048


@pytest.mark.parametrize("args, why", [(["--num-gpu-blocks-override", "100"], "KV pool size is given"),
                                       (["--tensor-parallel-size", "2"], "tensor parallelism"),
                                       (["--device", "cpu"], "CPU")])
def test_the_fit_steps_aside_where_the_user_sized_things_otherwise(tmp_path, args, why):
    plan = fit_for_launch(model_dir(tmp_path), args, {}, lambda env: ("RTX 4060", card(8)), nothing_used)
    assert plan.args() == [] and why in plan.summary


def test_memory_other_processes_hold_is_not_the_engines():
    """A desktop holding 1 GB of the card: the engine will count it as memory outside torch, so the plan does."""
    assert estimate(card(12), W8, SHAPE, EngineSettings(), others=GB).kv_bytes == \
        estimate(card(12), W8, SHAPE, EngineSettings()).kv_bytes - GB
    idle, busy = fit(card(12), W4, SHAPE4), fit(card(12), W4, SHAPE4, others=int(GB))
    assert busy.fits and busy.estimate.context < idle.estimate.context


def test_memory_in_use_comes_from_nvidia_smi_except_for_an_emulated_card(monkeypatch):
    import subprocess

    import app.checkpoints as checkpoints
    monkeypatch.setattr(checkpoints.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="NVIDIA GeForce RTX 3060, 1536\nNVIDIA GeForce RTX 3090, 10\n"))
    assert checkpoints.gpu_memory_used({}) == 1536 * 2**20
    assert checkpoints.gpu_memory_used({"CUDA_VISIBLE_DEVICES": "1"}) == 10 * 2**20
    assert checkpoints.gpu_memory_used({"LOCALCHAT_GPU_MEMORY_GIB": "8"}) is None


def test_the_launcher_reads_what_is_in_use_on_the_card(tmp_path):
    gpu = lambda env: ("RTX 3060", card(12))      # noqa: E731
    busy = fit_for_launch(model_dir(tmp_path), [], {}, gpu, lambda env: int(1.5 * GB))
    idle = fit_for_launch(model_dir(tmp_path), [], {}, gpu, nothing_used)
    assert "RTX 3060 (12 GiB, 1.50 GB in use by other processes)" in busy.summary
    assert "in use" not in idle.summary and busy.estimate.context < idle.estimate.context


# ---- the launcher --------------------------------------------------------------------------------------------
def model_dir(tmp_path: Path, quant: dict | None = AWQ) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant} if quant else CONFIG))
    (tmp_path / "preprocessor_config.json").write_text((REFERENCE_DIR / "preprocessor_config.json").read_text())
    return tmp_path


def test_the_launcher_puts_the_fitted_flags_before_the_users_and_prints_why(tmp_path):
    model = ResolvedModel(model_dir(tmp_path), "--model", "awq", demo=False)
    user = ["--max-num-seqs", "8"]
    fitted, args = fit_engine_flags(model, user, env={}, gpu=lambda env: ("NVIDIA GeForce RTX 3060", card(12)),
                                   used=nothing_used)
    assert args[-2:] == user and len(args) > len(user) and "--max-num-seqs" not in args[:-2]
    notes = "\n".join(fitted.notes)
    assert "engine flags for NVIDIA GeForce RTX 3060 (12 GiB): fitted" in notes and "LOCALCHAT_FIT=0 adds none" in notes
    assert "--mm-processor-kwargs '{\"max_pixels\": 1048576}': larger images are scaled down" in notes


@pytest.mark.parametrize("env, gpu", [({}, lambda env: None),                                  # no NVIDIA GPU
                                      ({"LOCALCHAT_FIT": "0"}, lambda env: ("RTX 4060", card(8)))])
def test_no_gpu_or_fit_turned_off_adds_nothing(tmp_path, env, gpu):
    model = ResolvedModel(model_dir(tmp_path), "--model", "awq", demo=False)
    assert fit_engine_flags(model, ["--max-num-seqs", "8"], env=env, gpu=gpu, used=nothing_used) == \
        (model, ["--max-num-seqs", "8"])


def test_the_demo_model_gets_nothing(tmp_path):
    demo = ResolvedModel(tmp_path / "smollm2.gguf", "built-in demo", "SmolLM2", demo=True)
    assert fit_engine_flags(demo, [], env={}, gpu=lambda env: ("RTX 4060", card(8)), used=nothing_used) == (demo, [])


def test_the_engines_parser_takes_the_fitted_flags():
    from engine.server.cli import parse_args
    steps = fit(card(8), W4, SHAPE4)                                        # smaller steps and image cache
    eager = fit(card(141), W4, SHAPE4, ["--gpu-memory-limit", "7.5"])       # no CUDA graphs
    assert set(flags_of(steps)) | set(flags_of(eager)) == {
        "--max-model-len", "--mm-processor-kwargs", "--cpu-embeddings", "--kv-cache-dtype",
        "--max-num-batched-tokens", "--max-num-seqs", "--encoder-cache-size", "--enforce-eager"}
    args, _ = parse_args(["--model", "m", *steps.args()])
    flags = flags_of(steps)
    assert args.mm_processor_kwargs == {"max_pixels": IMAGE_CAP_PIXELS} and args.cpu_embeddings
    assert args.max_model_len == int(flags["--max-model-len"]) and args.kv_cache_dtype == flags["--kv-cache-dtype"]
    assert args.max_num_batched_tokens == int(flags["--max-num-batched-tokens"])
    assert args.encoder_cache_size == int(flags["--encoder-cache-size"])
    args, _ = parse_args(["--model", "m", *eager.args()])
    assert args.enforce_eager


# ---- the README ----------------------------------------------------------------------------------------------
def test_the_readme_s_checkpoint_per_card_table_is_the_functions_output():
    # Each card gets the checkpoint the launcher names for it (with a GPU and no model), and the context and
    # images the fitted flags leave.
    assert readme_table((REPO / "README.md").read_text(), HUB_BEGIN, HUB_END) == hub_table()
    text = hub_table({(16, "Qwen/Qwen3-VL-8B-Instruct-FP8"): "41 tok/s decode (H100 as sm89)"})
    assert "| 16 GiB | `Qwen/Qwen3-VL-8B-Instruct-FP8` (fp8) | 10.6 GB | 23,552 tokens | up to 1024x1024 px each | " \
        "41 tok/s decode (H100 as sm89) |" in text


def test_the_readme_table_is_the_functions_output():
    """Regenerate with `python -m app.fit --table` and paste it over the README's table."""
    assert readme_table((REPO / "README.md").read_text()) == table()
