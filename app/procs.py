"""Child processes: start in their own process group, record in pid files, stop with all their descendants."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil


def _die_with_parent() -> None:
    """Runs in the child before exec: if the launcher is killed outright (SIGKILL, OOM), the kernel sends the
    child SIGTERM, so no engine is left holding GPU memory with nobody to stop it."""
    os.setsid()  # own process group: Ctrl-C in the terminal reaches only the launcher, which stops children in order
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None, tie_to_parent: bool = True) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr appended to log_path (so tracebacks land next to the log lines)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                preexec_fn=_die_with_parent if tie_to_parent else os.setsid)


def rotate(path: Path) -> None:
    """Keep the previous run's log as NAME.1 so each start begins a fresh, readable file."""
    if path.exists() and path.stat().st_size:
        path.replace(path.with_name(path.name + ".1"))


# ---- pid and state files -----------------------------------------------------------------------------------
def write_json(path: Path, obj) -> None:
    """Written beside and renamed over `path`, so that a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def write_pid(path: Path, pid: int, role: str) -> None:
    """Pid plus start time: a pid reused by an unrelated process after a crash must not be killed by `stop`."""
    write_json(path, {"pid": pid, "role": role, "create_time": psutil.Process(pid).create_time()})


def read_pid(path: Path) -> psutil.Process | None:
    """The live process a pid file names, or None (missing file, dead process, or pid reused)."""
    try:
        info = json.loads(path.read_text())
        proc = psutil.Process(info["pid"])
        if abs(proc.create_time() - info["create_time"]) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (OSError, ValueError, KeyError, psutil.Error):
        return None


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)


# ---- stopping ----------------------------------------------------------------------------------------------
def wait_exited(proc: psutil.Process, timeout: float) -> bool:
    """Whether `proc` exits within `timeout`. An exited process that is not our child stays a zombie until its
    own parent reaps it, and psutil's wait() would wait for that; for us it has stopped."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop_tree(pid: int, timeout: float = 15.0) -> list[int]:
    """SIGTERM a process, its process group and every descendant; SIGKILL whatever is left after `timeout`.
    Returns the pids that had to be killed."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)  # listed before the root dies and they get re-parented
    except psutil.NoSuchProcess:
        return []
    try:
        os.killpg(pid, signal.SIGTERM)  # the group we created with setsid; pgid == pid
    except (ProcessLookupError, PermissionError):
        pass
    for proc in procs:
        try:
            if os.getpgid(proc.pid) != pid:  # left our group (setsid of its own): signal it directly, once
                proc.terminate()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


# ---- probing -----------------------------------------------------------------------------------------------
def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return None


def http_json(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class LogFollower:
    """New complete lines of a growing log file, for showing the engine's load progress in the terminal."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]


def tail(path: Path, n: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []
