"""The run directory (pid files, state.json) and the `stop` and `status` commands that read it."""
from __future__ import annotations

import json
from pathlib import Path

import psutil

from app import procs
from app.settings import Settings

ROLES = ("supervisor", "proxy", "engine")  # stop order: the supervisor stops the other two itself


def pid_file(settings: Settings, role: str) -> Path:
    return settings.run_dir / f"{role}.pid"


def engine_status_file(settings: Settings) -> Path:
    """Written by the launcher while the engine is restarting or has failed; read by the proxy."""
    return settings.run_dir / "engine_status.json"


def state_file(settings: Settings) -> Path:
    return settings.run_dir / "state.json"


def write_state(settings: Settings, **state) -> None:
    procs.write_json(state_file(settings), state)


def read_state(settings: Settings) -> dict:
    try:
        return json.loads(state_file(settings).read_text())
    except (OSError, ValueError):
        return {}


def clear_run_dir(settings: Settings) -> None:
    for role in ROLES:
        procs.remove(pid_file(settings, role))
    procs.remove(state_file(settings))
    procs.remove(engine_status_file(settings))


def running(settings: Settings) -> dict[str, psutil.Process]:
    found = {}
    for role in ROLES:
        proc = procs.read_pid(pid_file(settings, role))
        if proc is not None:
            found[role] = proc
    return found


def stop(settings: Settings, timeout: float = 30.0) -> int:
    alive = running(settings)
    if not alive:
        clear_run_dir(settings)
        print("[app] nothing is running.")
        return 0
    supervisor = alive.pop("supervisor", None)
    if supervisor is not None:
        # The supervisor stops the engine, then the proxy, and removes the pid files; give it the time to do it.
        print(f"[app] stopping (launcher pid {supervisor.pid})…")
        supervisor.terminate()
        if not procs.wait_exited(supervisor, timeout):
            print("[app] the launcher did not stop in time; killing it and its children.")
            procs.stop_tree(supervisor.pid, timeout=5)
    # Whatever is still alive had no supervisor (it was killed) or survived it: stop it directly.
    for role, proc in running(settings).items():
        print(f"[app] stopping {role} (pid {proc.pid})…")
        procs.stop_tree(proc.pid)
    clear_run_dir(settings)
    print("[app] stopped.")
    return 0


def status(settings: Settings) -> int:
    alive = running(settings)
    state = read_state(settings)
    for role in ROLES:
        proc = alive.get(role)
        print(f"{role:>10}: " + (f"running (pid {proc.pid})" if proc else "not running"))
    health = procs.http_status(settings.engine_url + "/health")
    print(f"{'engine':>10}: {settings.engine_url}/health -> " + (str(health) if health else "no answer"))
    if state.get("model"):
        print(f"{'model':>10}: {state['model']}")
    # Through the proxy: the engine's own port answers only it (the run's key, app/launcher.py).
    stats = procs.http_json(settings.proxy_url + "/stats") if health == 200 else None
    if stats:
        print(f"{'KV blocks':>10}: {stats.get('num_used_gpu_blocks')} used / {stats.get('num_free_gpu_blocks')} "
              f"free / {stats.get('num_total_gpu_blocks')} total (block size {stats.get('block_size')}); "
              f"running {stats.get('num_running')}, waiting {stats.get('num_waiting')}")
    if alive and state.get("status") == "ready":
        print(f"{'open':>10}: {state.get('url')}")
    return 0 if alive else 3

