"""The device memory one process holds, as nvidia-smi counts it (pynvml where it imports, else nvidia-smi itself),
sampled every 100 ms in a thread and tagged with the phase the caller says it is in (bench/memory_caps.py)."""
from __future__ import annotations

import subprocess
import threading
import time


SAMPLE_S = 0.1


class GpuSampler:
    """Samples the device memory of process `pid` every SAMPLE_S seconds in a thread, each sample tagged with the
    phase the bench is in (set `phase`)."""

    def __init__(self, pid: int):
        self.pid, self.phase = pid, "start-up"
        self.samples: list[tuple[float, str, int]] = []       # (seconds since start, phase, MiB)
        self._stop = threading.Event()
        self._read = _nvml_reader() or gpu_used_mib
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self._read(self.pid)
            if used is not None:
                self.samples.append((round(time.monotonic() - self._start, 2), self.phase, used))
            self._stop.wait(SAMPLE_S)

    def stop(self) -> dict:
        """{peak_mib, peak_phase, peak_s, samples, per_phase: {phase: peak MiB}} (peak None: nothing read)."""
        self._stop.set()
        self._thread.join(5)
        per_phase: dict[str, int] = {}
        for _, phase, used in self.samples:
            per_phase[phase] = max(per_phase.get(phase, 0), used)
        peak = max(self.samples, key=lambda x: x[2], default=None)
        return {"peak_mib": peak[2] if peak else None, "peak_phase": peak[1] if peak else None,
                "peak_s": peak[0] if peak else None, "samples": len(self.samples), "per_phase": per_phase}


def _nvml_reader():
    """pynvml's per-process reading (no nvidia-smi process per sample), or None where it does not import."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        return None

    def read(pid: int) -> int | None:
        total = None
        for handle in handles:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    total = (total or 0) + p.usedGpuMemory // 2**20
        return total
    return read


def gpu_used_mib(pid: int) -> int | None:
    """Device memory the server's process holds now, as nvidia-smi sees it (None without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1])
    return None
