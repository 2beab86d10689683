"""Triton kernels for the quantized linears (engine/ops/quant.py holds their torch references; the layouts they
read are docs/QUANT_LAYOUTS.md):

    linear.py           wna16_linear, fp8_block_linear: the entry points (the references' signatures)
    table.py            the dispatch table: (format, tokens, device class) -> kernel and tiles (KernelChoice)
    wna16_fields.py     unpacking 4-/8-bit fields as floats (shared by the three 4-bit kernels)
    wna16_gemv.py       one token: the 4-bit GEMV
    wna16_gemm.py       2-64 tokens: the GEMM that dequantizes inside its K loop
    wna16_dequant.py    more tokens: dequantize, then cuBLAS
    fp8_w8a8.py         FP8 tensor cores: the one-launch kernel, activation quantization, the block-scaled GEMM,
                        cuBLAS's block-scaled GEMM
    fp8_weight_only.py  no FP8 tensor cores: the GEMV, dequantize then cuBLAS
    splitk.py           split-K: partial buffers, the tile's-last-program sum, the second-kernel reduction
"""
