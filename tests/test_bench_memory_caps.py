"""bench/memory_caps.py's host side: what it reads from an engine log, how it reports a cap that does not start,
and its summary table. (Its full run, servers under 8-24 GiB caps, is for the GPU machine.)"""
from __future__ import annotations

import json

import pytest

from bench.memory_caps import GpuSampler, fitted_flags, main, parse_log, table

LOG = """INFO 12-04 10:00:01 [memory.py:120] GPU memory limit: 8.00 GiB of 139.81 GiB (torch's allocator capped at 7.31 GiB; 0.69 GiB held outside it)
INFO 12-04 10:00:02 [loader.py:67] Loading model weights took 7.25 GB and 2.10 seconds (random dummy weights)
INFO 12-04 10:00:02 [loader.py:95] Token embeddings in host memory (1.24 GB, --cpu-embeddings; not in the weights above): the GPU reads the rows of each step's tokens over PCIe
INFO 12-04 10:00:05 [kv_sizing.py:45] Memory profile: weights 7.25 GB, activation peak 0.40 GB, KV cache 0.31 GB of 150.11 GB total; limit 8.59 GB (8.00 GiB): outside torch 0.74 GB, CUDA graphs + encoder cache 0.62 GB
WARNING 12-04 10:00:05 [llm_engine.py:75] max_model_len reduced from 4096 to 2096: the KV pool holds 2096 tokens under --gpu-memory-limit 8.00 GiB
INFO 12-04 10:00:09 [cuda_graphs.py:137] Captured CUDA graphs for 5 decode batch sizes (1..16) and 32 prefill sizes (up to 2048 tokens) in 3.9 s, using 0.55 GiB
"""


def test_the_start_up_lines_that_explain_a_cap_are_kept():
    lines = parse_log(LOG)
    assert lines["gpu_memory_limit"].startswith("8.00 GiB of 139.81 GiB")
    assert lines["weights"].startswith("7.25 GB")
    assert lines["host_embeddings"] == "1.24 GB"
    assert lines["memory_profile"].endswith("CUDA graphs + encoder cache 0.62 GB")
    assert lines["max_model_len_reduced"].startswith("4096 to 2096")
    assert lines["cuda_graphs"].endswith("using 0.55 GiB")
    assert "error" not in lines


def test_summary_table_and_json(tmp_path):
    failed = {"cap_gib": 8.0, "started": False, "reason": "the server exited with code 1 while starting: weights",
              "fitted_args": ["--max-num-seqs", "16"], "fitted_kv_tokens_computed": 5040}
    ran = {"cap_gib": 16.0, "started": True, "kv_tokens": 61440, "max_model_len": 61440, "ttft_ms_p50": 96.5,
           "decode_tok_s_p50": 310.2, "gpu_used_mib": 16000, "log_lines": {}, "fitted_args": [],
           "fitted_kv_tokens_computed": 60000}
    text = table([failed, ran])
    assert ("| 8 GiB | `--max-num-seqs 16` | no: the server exited with code 1 while starting: weights | 5040 / — |"
            in text)
    assert "| 16 GiB | `—` | yes | 60000 / 61440 | 61440 | 96.5 | 310.2 | 15.62 GiB | — | — |" in text
    ran |= {"nvidia_smi": {"peak_mib": 16500, "peak_phase": "burst of 16"}, "peak_within_cap": False}
    assert "| 16.11 GiB (burst of 16) | NO, by 116 MiB |" in table([ran])
    ran |= {"nvidia_smi": {"peak_mib": 16300, "peak_phase": "start-up"}, "peak_within_cap": True}
    assert "| 15.92 GiB (start-up) | yes |" in table([ran])


def test_the_sampler_reads_every_100_ms_and_keeps_each_phase_s_peak(monkeypatch):
    import time

    import bench.gpu_sampler as caps
    box = {}
    used = {"start-up": [300, 200], "burst of 16": [900, 400]}     # MiB read in turn while in each phase
    monkeypatch.setattr(caps, "_nvml_reader", lambda: lambda pid: used[box["sampler"].phase][
        sum(1 for s in box["sampler"].samples if s[1] == box["sampler"].phase) % 2] if "sampler" in box else 100)
    box["sampler"] = sampler = GpuSampler(1234)
    time.sleep(0.35)
    sampler.phase = "burst of 16"
    time.sleep(0.35)
    summary = sampler.stop()
    assert summary["peak_mib"] == 900 and summary["peak_phase"] == "burst of 16"
    assert summary["per_phase"]["start-up"] == 300 and 4 <= summary["samples"] <= 9




@pytest.mark.parametrize("gib, quantization, fits_by_default", [(12, "awq", False), (16, "fp8", False),
                                                                 (24, "fp8", True)])
def test_each_cap_gets_the_flags_the_launcher_fits_to_a_card_of_that_size(gib, quantization, fits_by_default):
    """The synthetic 8B directory (its config) with --quantization: the layout of its dummy weights."""
    from bench.synthetic_model import REFERENCE

    plan = fitted_flags(str(REFERENCE), gib, ["--quantization", quantization, "--load-format", "dummy"])
    assert plan.fits and plan.estimate.context >= 8192
    assert (plan.args() == []) == fits_by_default
    if not fits_by_default:
        assert '{"max_pixels": 1048576}' in plan.args()
        given = fitted_flags(str(REFERENCE), gib, ["-q", quantization, "--mm-processor-kwargs", "{}"])
        assert "--mm-processor-kwargs" not in given.args()     # a flag given to the bench wins


def test_an_8_gib_cap_moves_the_embeddings_to_host_memory():
    from bench.synthetic_model import REFERENCE

    plan = fitted_flags(str(REFERENCE), 8, ["--quantization", "awq"])
    assert "--cpu-embeddings" in plan.args()


@pytest.mark.slow
def test_a_cap_that_cannot_start_is_recorded_with_the_engines_reason(tmp_path):
    out = tmp_path / "caps.json"
    report = main(["--model", str(tmp_path / "missing"), "--caps", "12", "--log-dir", str(tmp_path),
                   "--out", str(out), "--device", "cpu", "--start-timeout", "120"])
    saved = json.loads(out.read_text())
    res = saved["caps"][0]
    assert res["cap_gib"] == 12 and res["started"] is False
    assert "exited with code 1" in res["reason"] and "does not exist" in res["reason"]
    assert "--gpu-memory-limit 12" in res["command"] and (tmp_path / "engine_cap12GiB.log").is_file()
    assert saved["engine_flags"] == ["--device", "cpu"] and "FileNotFoundError" in res["fit_error"]
    assert report["caps"] == saved["caps"]
