"""Triton kernels behind engine.ops (CUDA only; imported lazily by the dispatchers in engine/ops/*.py).

Each module mirrors one reference module and exposes functions with the reference's exact signatures:
embedding.embedding, kv_cache.store_kvcache, norm.rms_norm, rotary.apply_rotary / qk_norm_rope,
activation.silu_and_mul, attention.paged_attention / varlen_attention, and the quantized linears in the quant/
package (quant.linear.wna16_linear and fp8_block_linear, which also take explicit `tiles`, for benchmarks and
tests). The references (`*_ref`) are the specification; the tests in tests/test_ops_triton.py,
tests/test_ops_quant.py and tests/test_ops_quant_kernels.py (on the GPU, or on CPU with TRITON_INTERPRET=1) and
tests/test_ops_embedding.py compare the two on random inputs.
"""
