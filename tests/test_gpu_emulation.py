"""On a CUDA GPU (pytest -m gpu): ENGINE_EMULATE_ARCH reaches Triton's compiler. A process that emulates an RTX 30
card (sm86) compiles its kernels for sm86 (mma.sync, never Hopper's wgmma) and runs FP8 weights weight-only, the
e4m3 bytes decoded with integer operations; the answer is the reference's."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from servers import PYTHON, REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUN = """
import json, torch
from engine.ops.platform import device_caps
from engine.ops.quant import fp8_block_linear, fp8_block_linear_ref
from engine.ops.triton.quant import fp8_weight_only
torch.manual_seed(0)
w = (torch.randn(1024, 4096, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
s = torch.rand(8, 32, device="cuda") * 1e-3 + 1e-4
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
y = fp8_block_linear(x, w, s, (128, 128))
ref = fp8_block_linear_ref(x.float(), w, s, (128, 128))
kernels = [k for cache in fp8_weight_only._fp8_gemm_kernel.device_caches.values() for k in cache[0].values()]
print(json.dumps({"caps": device_caps(torch.device("cuda")).name, "arch": sorted({k.metadata.arch for k in kernels}),
                  "wgmma": any("wgmma" in k.asm["ptx"] for k in kernels),
                  "mma_sync": all("mma.sync" in k.asm["ptx"] for k in kernels),
                  "err": ((y.float() - ref).norm() / ref.norm()).item()}))
"""


def test_a_process_emulating_sm86_compiles_for_it_and_runs_fp8_weight_only():
    run = subprocess.run([PYTHON, "-c", RUN], cwd=REPO, env={**os.environ, "ENGINE_EMULATE_ARCH": "86"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["caps"] == "sm86 (emulated)" and out["arch"] == ["sm86"]   # the weight-only GEMM ran, for sm86
    assert not out["wgmma"] and out["mma_sync"]
    assert out["err"] < 1e-2
