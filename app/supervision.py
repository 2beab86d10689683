"""Keeping the engine up: an engine that exits unexpectedly is restarted after a back-off that doubles with each
crash in a row; after max_restarts crashes in a row the launcher gives up and says so. Meanwhile the proxy stays
up and serves the page; it learns what is going on from the engine status file written here (the proxy's
engine_status.py reads it), so the page shows "restarting" or "failed" with the reason instead of "offline".

EngineWatch is a small state machine polled by the launcher's supervise loop:
    running --exit--> backoff --delay over--> starting --/health 200--> running
       \\______________ crash max_restarts+1 times in a row ______________> failed
A crash while starting counts like any other; an engine that stays healthy for stable_s starts the count over.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app import procs


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5           # crashes in a row that are restarted; one more and the launcher gives up
    backoff_s: float = 1.0          # the first wait before a restart; doubled for each crash in a row
    max_backoff_s: float = 30.0
    stable_s: float = 60.0          # healthy this long: earlier crashes no longer count
    start_timeout_s: float = 1800.0  # a restart that is not healthy by then counts as a crash

    @classmethod
    def from_env(cls, env=os.environ, start_timeout_s: float = 1800.0) -> "RestartPolicy":
        return cls(max_restarts=int(env.get("ENGINE_MAX_RESTARTS", "5")),
                   backoff_s=float(env.get("ENGINE_RESTART_BACKOFF", "1")),
                   stable_s=float(env.get("ENGINE_STABLE_S", "60")), start_timeout_s=start_timeout_s)

    def delay(self, crashes: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, crashes - 1))


def describe_exit(code: int) -> str:
    """'exited with code 1' / 'was killed by SIGKILL (signal 9; the kernel's out-of-memory killer sends it too)'."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = "; the kernel's out-of-memory killer sends it too" if -code == signal.SIGKILL else ""
    return f"was killed by {name} (signal {-code}{hint})"


class EngineStatusFile:
    """The launcher's word on the engine for the proxy: {"state": "restarting" | "failed", "message", ...}."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, state: str, message: str, **extra) -> None:
        procs.write_json(self.path, {"state": state, "message": message, **extra})

    def clear(self) -> None:
        procs.remove(self.path)


class EngineWatch:
    def __init__(self, start: Callable[[], subprocess.Popen], healthy: Callable[[], bool], policy: RestartPolicy,
                 status: EngineStatusFile, log_path: Path, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.start, self.healthy, self.policy = start, healthy, policy
        self.status, self.log_path, self.say, self.clock = status, log_path, say, clock
        self.engine: subprocess.Popen | None = None
        self.state = "running"
        self.crashes = 0                # in a row
        self.since = clock()            # when the current state began
        self.restart_at = 0.0

    def attach(self, engine: subprocess.Popen) -> None:
        """The engine the launcher started and saw healthy."""
        self.engine, self.state, self.since = engine, "running", self.clock()

    def poll(self) -> None:
        now = self.clock()
        if self.state == "running":
            if self.crashes and now - self.since >= self.policy.stable_s:
                self.crashes = 0
            if self.engine.poll() is not None:
                self._crashed(describe_exit(self.engine.returncode))
        elif self.state == "backoff" and now >= self.restart_at:
            self._restart()
        elif self.state == "starting":
            if self.engine.poll() is not None:
                self._crashed(f"{describe_exit(self.engine.returncode)} while restarting")
            elif self.healthy():
                self.state, self.since = "running", now
                self.status.clear()
                self._note(f"the engine is back after restart {self.crashes}")
            elif now - self.since > self.policy.start_timeout_s:
                self.engine.kill()
                self.engine.wait(10)
                self._crashed(f"was not ready {self.policy.start_timeout_s:.0f}s after its restart")

    def _crashed(self, how: str) -> None:
        self.crashes += 1
        if self.crashes > self.policy.max_restarts:
            self.state = "failed"
            times = "once" if self.crashes == 1 else f"{self.crashes} times in a row"
            message = (f"The inference engine {how} and has now failed {times}; the "
                       f"launcher stopped restarting it. See {self.log_path} for why, then restart the app.")
            self.status.write("failed", message)
            self._note(message)
            return
        delay = self.policy.delay(self.crashes)
        self.state, self.since, self.restart_at = "backoff", self.clock(), self.clock() + delay
        message = (f"The inference engine {how}; restarting it in {delay:g}s (restart {self.crashes} of at most "
                   f"{self.policy.max_restarts}). See {self.log_path}.")
        # The parts of the message too, and when the restart is due (wall clock: the proxy reads it), so that
        # the proxy can say how it goes on after the countdown instead of repeating "in 1s".
        self.status.write("restarting", message, retry_after_s=max(1, round(delay + 1)), crash=how,
                          restart=self.crashes, max_restarts=self.policy.max_restarts,
                          restart_at=time.time() + delay, log=str(self.log_path))
        self._note(message)

    def _restart(self) -> None:
        self.engine = self.start()
        self.state, self.since = "starting", self.clock()

    def _note(self, message: str) -> None:
        """In the launcher's output and in the engine's log, next to the lines that say why it died."""
        self.say(message)
        try:
            with open(self.log_path, "a") as log:
                log.write(f"[app] {message}\n")
        except OSError:
            pass
