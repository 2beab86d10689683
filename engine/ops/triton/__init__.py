"""Triton kernels behind engine.ops (CUDA only; imported lazily by the dispatchers in engine/ops/*.py).

Each module mirrors one reference module and exposes functions with the reference's exact signatures:
embedding.embedding, kv_cache.store_kvcache, norm.rms_norm, rotary.apply_rotary / qk_norm_rope,
activation.silu_and_mul, attention.paged_attention / varlen_attention, wna16.wna16_linear and
fp8_block.fp8_block_linear (these two also take an explicit `config`, for benchmarks and tests). The references
(`*_ref`) are the specification; the tests in tests/test_ops_triton.py (on the GPU, or on CPU with
TRITON_INTERPRET=1), tests/test_ops_quant.py (GPU) and tests/test_ops_embedding.py compare the two on random
inputs.
"""
