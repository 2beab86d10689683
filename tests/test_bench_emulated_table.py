"""bench/emulated_table.py: the emulated-paths table and its two rules, read from bench/offline.py's JSON (the runs
themselves are bench/emulated_paths.sh's, on the GPU machine)."""
from __future__ import annotations

import json

from bench.emulated_table import failures, main, read_runs, render


def run(b1: float, b8: float, tput: float, ttft: float) -> dict:
    return {"device": "NVIDIA H100", "ttft_8192_ms": ttft, "decode": [{"batch": 1, "ms_per_step": b1},
                                                                     {"batch": 8, "ms_per_step": b8}],
            "throughput": [{"requests": 64, "output_tok_s": tput}]}


def write(tmp_path, runs: dict) -> None:
    for (card, fmt), res in runs.items():
        (tmp_path / f"offline_{card}_{fmt}.json").write_text(json.dumps(res))


def test_paths_that_keep_both_rules_pass(tmp_path, capsys):
    write(tmp_path, {("native", "bf16"): run(6.0, 6.5, 7000, 160), ("native", "fp8"): run(3.5, 3.7, 7700, 150),
                     ("sm86", "bf16"): run(6.2, 6.9, 6500, 170), ("sm86", "fp8"): run(4.0, 4.6, 6600, 168)})
    assert main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "| sm86 | fp8 | 4.00 ms | 4.60 ms | 1.15 | 6600 tok/s | 168 ms |" in out
    assert "every path" in out


def test_a_batch_8_step_over_1_3_times_batch_1_and_fp8_slower_than_bf16_fail(tmp_path, capsys):
    # The weight-only FP8 path as first measured: batch 8 at 11.16 ms against its own 5.04 ms at batch 1.
    write(tmp_path, {("sm86", "bf16"): run(6.2, 6.9, 6500, 170), ("sm86", "fp8"): run(5.04, 11.16, 4155, 218)})
    runs = read_runs(tmp_path)
    assert set(runs) == {("sm86", "bf16"), ("sm86", "fp8")}
    broken = failures(runs)
    assert broken[0] == "sm86 fp8: batch-8 step 11.16 ms > 1.3 x batch-1 5.04 ms"
    assert {line.split()[2] for line in broken[1:]} == {"b8_ms", "tput64", "ttft8192_ms"}   # b1 is faster
    assert main(str(tmp_path)) == 1
    assert "FAIL sm86: fp8 tput64 4155.00 is slower than bf16's 6500.00" in capsys.readouterr().out


def test_a_run_that_did_not_finish_shows_dashes(tmp_path):
    write(tmp_path, {("sm80", "awq"): {"device": "x", "decode": [{"batch": 1, "ms_per_step": 4.0}]}})
    assert "| sm80 | awq | 4.00 ms | - ms | - | - tok/s | - ms |" in render(read_runs(tmp_path))
    assert failures(read_runs(tmp_path)) == []
