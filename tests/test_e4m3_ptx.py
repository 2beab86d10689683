"""The packed e4m3 decode's PTX (engine/ops/triton/kv_cache.py: E4M3_TO_BF16_PTX, E4M3_TO_F16_PTX), run here
instruction by instruction by a small interpreter of the six instructions it uses, for every byte, four to a
register as tl.inline_asm_elementwise packs them (element i in byte i; values 2i and 2i+1 in the low and high
halves of output register i). The GPU runs the same text (tests/test_ops_triton_kv_fp8.py checks it there); this
checks the program itself on any machine: each e4m3 value exactly, signed zeros and subnormals included, and the
two NaN bytes as +-480 (no encoder writes them)."""
from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("triton")

from engine.ops.triton.kv_cache import E4M3_TO_BF16_PTX, E4M3_TO_F16_PTX  # noqa: E402


def _bits_to_float(half: int, dtype: torch.dtype) -> float:
    return torch.tensor([half], dtype=torch.int32).to(torch.int16).view(dtype).double().item() if half < 32768 \
        else torch.tensor([half - 65536], dtype=torch.int32).to(torch.int16).view(dtype).double().item()


def _float_to_bits(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor([value], dtype=dtype).view(torch.int16).to(torch.int32).item()) & 0xFFFF


def run_ptx(program: str, x: int) -> tuple[int, int]:
    """Interprets `program` with $2 = x; returns ($0, $1). Registers are 32-bit; fma.rn.{bf16,f16}x2 works on
    the two 16-bit halves (exact products here, rounded to the half's type)."""
    regs = {"$2": x}

    def val(operand: str) -> int:
        return int(operand, 0) if operand[0].isdigit() else regs[operand]

    for line in program.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "prmt.b32":   # bytes 0-3 from a, 4-7 from b; selector nibble i picks the source of byte i
            a, b, sel = (val(s) for s in src)
            pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            regs[d] = sum(pool[(sel >> 4 * i) & 0x7] << 8 * i for i in range(4))
        elif op == "and.b32":
            regs[d] = val(src[0]) & val(src[1])
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":   # the truth table indexed by (a, b, c) bits, a weighing 4 (a = 0xF0, b = 0xCC, c = 0xAA)
            a, b, c, lut = (val(s) for s in src)
            regs[d] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))
        elif (m := re.fullmatch(r"fma\.rn\.(bf16|f16)x2", op)):
            dtype = torch.bfloat16 if m.group(1) == "bf16" else torch.float16
            a, b, c = (val(s) for s in src)
            halves = [_float_to_bits(_bits_to_float(a >> s & 0xFFFF, dtype) * _bits_to_float(b >> s & 0xFFFF, dtype)
                                     + _bits_to_float(c >> s & 0xFFFF, dtype), dtype) for s in (0, 16)]
            regs[d] = halves[0] | halves[1] << 16
        else:
            raise AssertionError(f"an instruction this interpreter does not know: {line}")
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("program,dtype", [(E4M3_TO_BF16_PTX.value, torch.bfloat16),
                                           (E4M3_TO_F16_PTX.value, torch.float16)], ids=["bf16", "fp16"])
def test_the_ptx_decodes_every_byte_exactly(program, dtype):
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    want[[0x7F, 0xFF]] = torch.tensor([480.0, -480.0], dtype=torch.float64)
    for first in range(0, 256, 4):
        packed = sum((first + i) << 8 * i for i in range(4))
        out = run_ptx(program, packed)
        got = [_bits_to_float(out[i // 2] >> 16 * (i % 2) & 0xFFFF, dtype) for i in range(4)]
        for i, value in enumerate(got):
            ref = want[first + i].item()
            assert value == ref and math.copysign(1, value) == math.copysign(1, ref), (hex(first + i), value, ref)
