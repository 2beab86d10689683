"""The prefill behind a vision encoder run goes op by op only while the host keeps ahead of the device: the
first such step after the warm-up is timed (host launch time against the device's time for the step) and
decides for the rest."""
from __future__ import annotations

import pytest

from engine import runner


class FakeEvent:
    """A CUDA event on a fake clock: `now[0]` ms when recorded; done once `done[0]` is set."""
    now, done = [0.0], [False]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = FakeEvent.now[0]

    def query(self):
        return FakeEvent.done[0]

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.mark.parametrize("host_ms, device_ms, allowed", [(26.5, 35.5, True), (34.0, 35.5, False)])
def test_the_first_timed_step_decides(monkeypatch, host_ms, device_ms, allowed):
    monkeypatch.setattr(runner.torch.cuda, "Event", FakeEvent)
    clock = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    FakeEvent.now, FakeEvent.done = [0.0], [False]
    check = runner.EagerCheck(enabled=True)
    for _ in range(check.WARMUP_RUNS):        # graph captures and kernel compiles: not timed
        check.vision_starting()
        check.launched()
        assert check._pending is None and check.allowed
    check.vision_starting()
    clock[0] = host_ms / 1e3                # the host has launched the step
    FakeEvent.now[0] = device_ms            # the device's end of the step, once it gets there
    check.launched()
    check.vision_starting()
    assert check.allowed and check._begin is None    # not done yet: nothing decided, no new timing
    FakeEvent.done[0] = True
    check.vision_starting()
    assert check.allowed is allowed
    check.vision_starting()
    assert check._begin is None and check._pending is None           # decided once, for good


def test_the_cpu_never_goes_eager(monkeypatch):
    monkeypatch.setattr(runner.torch.cuda, "Event", FakeEvent)
    cpu = runner.EagerCheck(enabled=False)
    for _ in range(5):
        cpu.vision_starting()
        cpu.launched()
    assert not cpu.allowed and cpu._begin is None and cpu._pending is None
