"""A real `python -m engine` process on a free port for the HTTP API tests, and plain-HTTP helpers around it.

Each server test module starts one process (a module-scoped fixture) on a tiny random model, so the tests see
exactly what clients see: the real socket, the real SSE bytes, the real start-up and log.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Importing torch and building the model on a 2-core CI machine is slow; a hang must still end.
START_TIMEOUT_S = float(os.environ.get("TEST_ENGINE_START_TIMEOUT", "240"))
# Small and fixed, so the KV pool is the same on every machine and the tests' block accounting is exact.
BASE_ARGS = ("--num-gpu-blocks-override", "256", "--max-model-len", "2048", "--swap-space", "0.01",
             "--enforce-eager")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EngineServer:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path
    api_key: str | None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_engine_server(model_dir: Path, log_dir: Path, *extra_args: str, api_key: str | None = None,
                        served_name: str | None = None, env: dict[str, str] | None = None) -> EngineServer:
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "--model", str(model_dir), "--port", str(port), *BASE_ARGS, *extra_args]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if api_key:
        cmd += ["--api-key", api_key]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"engine-{port}.log"
    # VLLM_API_KEY from the developer's shell must not turn on auth for a server the test started without one.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": "", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env)
    server = EngineServer(proc, f"http://127.0.0.1:{port}", port, log_path, api_key)
    _wait_healthy(server)
    return server


def _wait_healthy(server: EngineServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the engine exited with code {server.proc.returncode} while starting:\n"
                               f"{server.log_text()[-4000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the engine was not healthy after {START_TIMEOUT_S:.0f}s:\n{server.log_text()[-4000:]}")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: dict | list | bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> Reply:
    """One request; HTTP errors are returned, not raised. A dict/list body is sent as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, method=method, headers={**hdrs, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, dict(resp.headers), resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as err:
        return Reply(err.code, dict(err.headers), err.read().decode("utf-8", "replace"))


def stats(server: EngineServer) -> dict:
    reply = http("GET", server.url + "/stats", headers=server.auth, timeout=10)
    assert reply.status == 200, reply.text
    return reply.json()


def wait_blocks_free(server: EngineServer, timeout: float = 2.0) -> tuple[float, dict]:
    """(seconds until nothing runs and every GPU block is free, the last /stats); fails after `timeout`."""
    start = time.monotonic()
    while True:
        s = stats(server)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_gpu_blocks"] == s["num_total_gpu_blocks"]:
            return time.monotonic() - start, s
        if time.monotonic() - start > timeout:
            raise AssertionError(f"blocks not freed {timeout}s later: {s}")
        time.sleep(0.05)
