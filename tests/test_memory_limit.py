"""--gpu-memory-limit: the whole engine (weights, activation peak, CUDA graphs, encoder cache, KV pool, and what
the process holds outside torch) stays under an absolute size, as on a card that size. The budget arithmetic and
the CLI are checked here on the CPU; the CUDA wiring against a simulated allocator (torch.cuda's counters
replaced), and for real in tests/test_gpu_memory_limit.py."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import pytest
import torch

from engine.args import EngineArgs, add_cli_args
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.sizing import LIMIT_SLACK_BYTES
from engine.worker.memory import (GiB, MemoryProfile, allocator_fraction, apply_gpu_memory_limit,
                           check_limit, check_weights_fit, encoder_cache_bytes, kv_budget, no_kv_room_message,
                           profile_cuda, usable_bytes, weights_out_of_memory)
from engine_helpers import make_llm

REFERENCE_8B = Path(__file__).resolve().parent.parent / "bench" / "model_configs" / "qwen3-vl-8b-instruct"


# ---- the arithmetic ----------------------------------------------------------------------------------------
def test_the_limit_replaces_the_utilization_share():
    assert usable_bytes(total=140 * GiB, gpu_memory_utilization=0.9, limit=None) == int(126 * GiB)
    assert usable_bytes(total=140 * GiB, gpu_memory_utilization=0.9, limit=8 * GiB) == 8 * GiB


def test_kv_budget_is_what_the_fixed_costs_leave():
    # an 8 GiB card, 4-bit weights of 6 GiB, a 0.75 GiB step, 0.5 GiB of CUDA context, 0.5 GiB of graph pools
    assert kv_budget(8 * GiB, 6 * GiB, 3 * GiB // 4, GiB // 2, GiB // 2) == GiB // 4
    assert kv_budget(8 * GiB, 8 * GiB, GiB, GiB // 2) < 0


def test_the_allocator_cap_leaves_room_for_what_torch_does_not_hold():
    assert allocator_fraction(limit=8 * GiB, non_torch=GiB // 2, total=140 * GiB) == pytest.approx(7.5 / 140)
    assert allocator_fraction(limit=GiB, non_torch=2 * GiB, total=140 * GiB) == 0


def test_a_limit_beyond_the_card_or_below_its_context_is_refused():
    with pytest.raises(ModelLoadError, match=r"200\.00 GiB is more than this GPU has \(139\.80 GiB\)"):
        check_limit(200 * GiB, int(139.8 * GiB), GiB // 2)
    with pytest.raises(ModelLoadError, match=r"0\.40 GiB leaves nothing.*0\.50 GiB"):
        check_limit(int(0.4 * GiB), 140 * GiB, GiB // 2)
    check_limit(8 * GiB, 140 * GiB, GiB // 2)


def test_weights_over_the_limit_are_refused_with_the_numbers():
    with pytest.raises(ModelLoadError, match=r"weights \(16\.34 GiB\) do not fit under --gpu-memory-limit 8\.00 "
                                             r"GiB.*quantized checkpoint"):
        check_weights_fit(8 * GiB, int(16.34 * GiB), GiB // 2)
    check_weights_fit(8 * GiB, 7 * GiB, GiB // 2)


def test_no_room_for_kv_names_every_number_and_the_fixes():
    p = MemoryProfile(weights_bytes=int(6.5 * GiB), activation_peak_bytes=int(1.25 * GiB),
                      non_torch_bytes=GiB // 2, reserve_bytes=GiB, kv_budget_bytes=-int(1.25 * GiB),
                      total_bytes=140 * GiB, limit_bytes=8 * GiB)
    msg = no_kv_room_message(p, bytes_per_block=2_359_296, block_size=16)
    for part in ("--gpu-memory-limit", "2.2 MiB", "weights 6.50 GiB", "activation peak 1.25 GiB",
                 "outside torch 0.50 GiB", "graphs + encoder cache + slack 1.00 GiB", "KV cache 0.00 GiB",
                 "limit 8.00 GiB", "--max-num-batched-tokens", "max_pixels", "--enforce-eager"):
        assert part in msg, part


def test_encoder_cache_reserve_at_the_8b_shapes():
    cfg = ModelConfig.from_model_dir(REFERENCE_8B)
    # each LLM token of image: the merger's row and 3 deepstack rows of 4096 bf16 values
    assert encoder_cache_bytes(cfg, 16384, torch.bfloat16) == 16384 * 4 * 4096 * 2
    assert encoder_cache_bytes(cfg, 16384, torch.float32) == 16384 * 4 * 4096 * 4


# ---- the CLI -----------------------------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "m", *argv])


@pytest.mark.parametrize("text, gib", [("8", 8.0), ("11.5", 11.5), ("12GiB", 12.0), ("24gib", 24.0)])
def test_cli_takes_gib(text, gib):
    ns = parse("--gpu-memory-limit", text)
    assert EngineArgs.from_cli(ns).gpu_memory_limit == gib
    assert EngineArgs.from_cli(parse()).gpu_memory_limit is None


@pytest.mark.parametrize("text", ["12GB", "eight", "0", "-4", "inf", "nan"])
def test_cli_refuses_what_is_not_a_positive_size_in_gib(text, capsys):
    with pytest.raises(SystemExit):
        parse("--gpu-memory-limit", text)
    assert "--gpu-memory-limit" in capsys.readouterr().err


def test_engine_args_refuse_a_non_positive_limit():
    with pytest.raises(ValueError, match="gpu_memory_limit"):
        EngineArgs(model="m", gpu_memory_limit=0)


# ---- the CUDA wiring, on a simulated allocator -------------------------------------------------------------
class FakeAllocator:
    """torch.cuda's memory counters for one device: `other` bytes held outside torch, torch's own blocks in
    `reserved`, and a cap set by set_per_process_memory_fraction that allocations beyond raise at."""

    def __init__(self, total: int, other: int, reserved: int = 0, per_graph: int = 0):
        self.total, self.other, self.reserved, self.peak = total, other, reserved, reserved
        self.fraction = 1.0
        self.per_graph = per_graph      # what an instantiated CUDA graph holds outside torch, until it is freed

    def alloc(self, n: int) -> None:
        if self.reserved + n > self.fraction * self.total:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n / GiB:.2f} GiB")
        self.reserved += n
        self.peak = max(self.peak, self.reserved)

    def free(self, n: int) -> None:
        self.reserved -= n

    def install(self, monkeypatch) -> None:
        def set_fraction(f, device):
            # torch raises for a torch.device without an index ("cuda"); an int always names one
            assert isinstance(device, int), f"set_per_process_memory_fraction needs a device index, got {device!r}"
            self.fraction = f
        counters = {"mem_get_info": lambda device=None: (self.total - self.other - self.reserved, self.total),
                    "memory_reserved": lambda device=None: self.reserved,
                    "memory_allocated": lambda device=None: self.reserved,
                    "max_memory_reserved": lambda device=None: self.peak,
                    "max_memory_allocated": lambda device=None: self.peak,
                    "reset_peak_memory_stats": lambda device=None: setattr(self, "peak", self.reserved),
                    "synchronize": lambda device=None: None, "empty_cache": lambda: None,
                    "set_per_process_memory_fraction": set_fraction, "current_device": lambda: 0}
        for name, fn in counters.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        fake = self

        class Graph:
            def __del__(self):
                fake.other -= getattr(self, "held", 0)

        @contextlib.contextmanager
        def capture(graph, pool=None):
            yield
            graph.held = fake.per_graph
            fake.other += fake.per_graph
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", capture)


CUDA = torch.device("cuda", 0)


def step_of(fake: FakeAllocator, nbytes: int):
    def run():
        fake.alloc(nbytes)
        fake.free(nbytes)
    return run


def test_limit_caps_the_allocator_and_sizes_the_pool(monkeypatch):
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    limit = apply_gpu_memory_limit(8.0, CUDA)
    assert limit == 8 * GiB and fake.fraction == pytest.approx(7.5 / 140)
    fake.alloc(6 * GiB)                                       # the weights
    p = profile_cuda(step_of(fake, GiB), 6 * GiB, 0.9, CUDA, limit, reserve_bytes=GiB // 4)
    assert (p.weights_bytes, p.activation_peak_bytes, p.non_torch_bytes, p.reserve_bytes) == \
        (6 * GiB, GiB, GiB // 2, GiB // 4)
    assert p.kv_budget_bytes == GiB // 4 and p.usable_bytes == 8 * GiB
    fake.alloc(p.kv_budget_bytes + p.reserve_bytes)           # the pool and the graphs fit ...
    fake.alloc(p.activation_peak_bytes)                       # ... with the step's peak on top
    with pytest.raises(torch.cuda.OutOfMemoryError):          # and nothing more: as on an 8 GiB card
        fake.alloc(2 * 2**20)


def test_weights_over_the_limit_stop_the_profile(monkeypatch):
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2, reserved=int(7.8 * GiB))
    fake.install(monkeypatch)
    with pytest.raises(ModelLoadError, match=r"weights \(7\.80 GiB\) do not fit under --gpu-memory-limit 8\.00"):
        profile_cuda(step_of(fake, GiB), int(7.8 * GiB), 0.9, CUDA, 8 * GiB)


def test_a_step_over_the_limit_is_a_load_error_naming_the_knobs(monkeypatch):
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    limit = apply_gpu_memory_limit(8, CUDA)
    fake.alloc(6 * GiB)
    with pytest.raises(ModelLoadError, match=r"worst-case step.*8\.00 GiB.*6\.00 GiB\): out of memory: tried to "
                                             r"allocate 2\.00 GiB; .*max-num-batched-tokens"):
        profile_cuda(step_of(fake, 2 * GiB), 6 * GiB, 0.9, CUDA, limit)


def test_weights_that_run_out_of_memory_while_loading_are_a_load_error(monkeypatch):
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    limit = apply_gpu_memory_limit(8, CUDA)
    with pytest.raises(torch.cuda.OutOfMemoryError) as oom:
        for _ in range(40):                               # a 17.5 GB model, placed tensor by tensor
            fake.alloc(GiB // 2)
    err = weights_out_of_memory(limit, CUDA, oom.value)
    assert err.message == ("the model's weights do not fit under --gpu-memory-limit 8.00 GiB: loading them ran out "
                           "of memory: tried to allocate 0.50 GiB with 7.50 GiB placed; use a quantized checkpoint "
                           "(README: 'Which checkpoint for which GPU') or raise the limit")


def test_without_a_limit_the_utilization_share_is_used_and_nothing_is_reserved(monkeypatch):
    fake = FakeAllocator(total=100 * GiB, other=GiB)
    fake.install(monkeypatch)
    fake.alloc(17 * GiB)
    p = profile_cuda(step_of(fake, 2 * GiB), 17 * GiB, 0.9, CUDA, None, reserve_bytes=GiB)
    assert p.limit_bytes is None and p.reserve_bytes == 0
    assert p.kv_budget_bytes == 90 * GiB - 17 * GiB - 2 * GiB - GiB
    assert fake.fraction == 1.0


def test_a_limit_larger_than_the_card_is_refused_before_loading(monkeypatch):
    FakeAllocator(total=24 * GiB, other=GiB // 2).install(monkeypatch)
    with pytest.raises(ModelLoadError, match=r"32\.00 GiB is more than this GPU has \(24\.00 GiB\)"):
        apply_gpu_memory_limit(32, CUDA)


def test_profile_steps_and_reserve_run_on_a_real_model(qwen3_vl_dir, monkeypatch):
    """The profile's steps on a real (tiny, CPU) model. The simulated counters see none of its memory, so what
    they report is the fixed part: the reserve is a full encoder cache and the allocator's slack (no graphs off
    CUDA), and the graph-pool estimate is every graph's output plus the vision graph's static inputs, with the
    prefill graphs or without them (their largest step, a padded decode batch, runs too)."""
    from engine.worker.cache_engine import CacheEngine
    from engine.sizing import PREFILL_BUCKETS, batch_size_ladder
    from engine.worker.kv_sizing import _decoder_graph_pool_bytes, _largest_image, _profile, _vision_graph_pool_bytes

    llm = make_llm(qwen3_vl_dir, device="cpu", max_num_seqs=8)
    engine, cfg = llm.engine.model_executor.driver_worker, llm.engine.model_config     # rank 0's Worker: what kv_sizing sizes
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    fake.alloc(GiB)                                           # the "weights"
    engine.gpu_memory_limit = 4 * GiB
    p = _profile(engine, 2048, bytes_per_block=16 * 1024)
    cache = encoder_cache_bytes(cfg, engine.args.encoder_cache_size, engine.dtype)
    assert p.reserve_bytes == cache + LIMIT_SLACK_BYTES and cache > 0 and p.prefill_graphs
    assert p.kv_budget_bytes == 4 * GiB - GiB - GiB // 2 - cache - LIMIT_SLACK_BYTES

    scratch = CacheEngine(cfg, 2048 // 16, 0, 16, engine.dtype, engine.device)
    pixels, _ = _largest_image(engine, 2048, 16384)
    itemsize = torch.tensor([], dtype=engine.dtype).element_size()
    decode_outputs = sum(batch_size_ladder(8)) * cfg.hidden_size * itemsize
    static = pixels.shape[0] * (pixels.shape[1] + cfg.vision.hidden_size) * itemsize
    assert _decoder_graph_pool_bytes(engine, 2048, scratch, prefill=True) == \
        decode_outputs + sum(PREFILL_BUCKETS) * cfg.hidden_size * itemsize
    assert _decoder_graph_pool_bytes(engine, 2048, scratch, prefill=False) == decode_outputs
    assert _vision_graph_pool_bytes(engine, 2048) == static


@pytest.mark.parametrize("spare_blocks, prefill_graphs", [(512, False), (513, True)])
def test_under_a_limit_a_pool_too_small_for_the_prefill_scratch_sets_aside_the_decode_graphs_alone(
        qwen3_vl_dir, monkeypatch, spare_blocks, prefill_graphs):
    """The prefill graphs keep 2 x 2048 tokens of scratch KV blocks out of the pool, and are dropped where that
    is half the pool or more; the decode graphs need none and stay (eager decode steps are ~10x slower). Under a
    limit the profile then sets aside the decode graphs' pool alone, and the KV pool gets the difference."""
    import engine.sizing
    import engine.worker.cuda_graphs as cuda_graphs
    from engine.worker.kv_sizing import _profile

    llm = make_llm(qwen3_vl_dir, device="cpu", max_num_seqs=8)
    worker, cfg = llm.engine.model_executor.driver_worker, llm.engine.model_config
    monkeypatch.setattr(cuda_graphs, "cuda_graphs_wanted", lambda args, device: True)
    assert engine.sizing.scratch_blocks_needed(16) == 256
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    fake.alloc(GiB)                                           # the "weights"
    per_block = 16 * 1024
    itemsize = torch.tensor([], dtype=worker.dtype).element_size()
    prefill_pool = sum(engine.sizing.PREFILL_BUCKETS) * cfg.hidden_size * itemsize   # the prefill graphs' outputs
    worker.gpu_memory_limit = 4 * GiB
    roomy = _profile(worker, 2048, per_block)
    # The limit that leaves `spare_blocks` blocks of pool once the prefill graphs' pool is set aside:
    worker.gpu_memory_limit = 4 * GiB - roomy.kv_budget_bytes + spare_blocks * per_block
    p = _profile(worker, 2048, per_block)
    assert p.prefill_graphs == prefill_graphs
    if prefill_graphs:
        assert (p.reserve_bytes, p.kv_budget_bytes) == (roomy.reserve_bytes, spare_blocks * per_block)
    else:
        assert p.reserve_bytes == roomy.reserve_bytes - prefill_pool
        assert p.kv_budget_bytes == spare_blocks * per_block + prefill_pool
        assert "graphs (decode only) + encoder cache" in p.describe()


def test_under_a_limit_the_profile_measures_the_largest_prefill_graph_with_small_steps(qwen3_vl_dir, monkeypatch):
    """With --max-num-batched-tokens under the largest prefill bucket (2048), the profile's scratch KV cache still
    holds that bucket's tokens: the graph-pool measure writes them (an 8 GiB H100 run read out of bounds)."""
    import engine.worker.cuda_graphs as cuda_graphs
    from engine.worker.kv_sizing import _profile

    llm = make_llm(qwen3_vl_dir, device="cpu", max_num_seqs=8, max_num_batched_tokens=256)
    worker = llm.engine.model_executor.driver_worker
    monkeypatch.setattr(cuda_graphs, "cuda_graphs_wanted", lambda args, device: True)
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    fake.alloc(GiB)
    worker.gpu_memory_limit = 4 * GiB
    assert _profile(worker, 2048, bytes_per_block=16 * 1024).prefill_graphs


def test_under_a_limit_what_each_cuda_graph_holds_outside_torch_is_set_aside(qwen3_vl_dir, monkeypatch):
    """nvidia-smi counts the instantiated graphs, which torch's allocator does not hold: the profile captures one
    decode graph, measures what it took outside torch and sets that aside for every graph to come."""
    import engine.sizing
    import engine.worker.cuda_graphs as cuda_graphs
    from engine.worker.kv_sizing import _profile

    llm = make_llm(qwen3_vl_dir, device="cpu", max_num_seqs=8)
    worker = llm.engine.model_executor.driver_worker
    monkeypatch.setattr(cuda_graphs, "cuda_graphs_wanted", lambda args, device: True)
    profiles = {}
    for per_graph in (0, 3 << 20):
        fake = FakeAllocator(total=140 * GiB, other=GiB // 2, per_graph=per_graph)
        fake.install(monkeypatch)
        fake.alloc(GiB)
        worker.gpu_memory_limit = 4 * GiB
        profiles[per_graph] = _profile(worker, 2048, 16 * 1024)
        assert fake.other == GiB // 2                        # the measured graph is gone again
    graphs = len(engine.sizing.batch_size_ladder(8)) + len(engine.sizing.PREFILL_BUCKETS)
    assert profiles[3 << 20].reserve_bytes - profiles[0].reserve_bytes == graphs * (3 << 20)
    assert profiles[0].kv_budget_bytes - profiles[3 << 20].kv_budget_bytes == graphs * (3 << 20)


def test_once_ready_the_allocator_is_capped_at_what_the_limit_leaves_beside_what_is_held_outside(monkeypatch,
                                                                                                 engine_log):
    from engine.worker.memory import hold_to_limit
    fake = FakeAllocator(total=140 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    fake.alloc(6 * GiB)
    fake.other += 256 << 20            # kernels loaded and graphs instantiated since the profile
    assert hold_to_limit(8 * GiB, CUDA) == 6 * GiB + (768 << 20)
    assert fake.fraction == pytest.approx((8 * GiB - (768 << 20)) / (140 * GiB))
    assert "held of --gpu-memory-limit 8.00 GiB" in engine_log.records[-1].getMessage()
    fake.other += 2 * GiB              # more than the limit leaves: said, and the allocator may not grow
    assert hold_to_limit(8 * GiB, CUDA) > 8 * GiB
    assert "over --gpu-memory-limit 8.00 GiB by 768 MiB" in engine_log.records[-1].getMessage()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fake.alloc(2 << 20)


def test_the_prefill_graphs_take_their_scratch_only_from_a_pool_twice_its_size():
    from engine.sizing import prefill_scratch_blocks
    assert prefill_scratch_blocks(512, 16) == 0          # 2 x 2048 tokens would be half of this pool
    assert prefill_scratch_blocks(513, 16) == 256
    assert prefill_scratch_blocks(10_000, 32) == 128


# ---- on the CPU, the limit does not apply --------------------------------------------------------------------
def test_on_cpu_the_limit_is_ignored_with_a_warning(qwen3_dir, engine_log):
    llm = make_llm(qwen3_dir, device="cpu", gpu_memory_limit=8)
    assert llm.engine.kv_cache_config.gpu_memory_limit is None
    assert any("--gpu-memory-limit 8.00 GiB applies to CUDA devices only" in r.getMessage()
               for r in engine_log.records)
