"""Real processes for the proxy, browser and launcher tests: `python -m engine` and `python -m proxy` on free
ports, their output captured in log files under the test's temp dir, stopped with all their children.

Test modules import the fixtures they use by name (`from servers import engine, proxy`), since fixtures
live here and not in conftest.py.
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

import pytest

from app.procs import stop_tree

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SERVED_NAME = "tiny-qwen3-vl"
# Importing torch and building the model on a 2-core CI machine is slow; a hang must still end.
ENGINE_START_TIMEOUT = float(os.environ.get("TEST_ENGINE_START_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) for one request; HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
    text = raw.decode("utf-8", "replace")
    return status, (json.loads(text) if "json" in ctype else text)


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20) -> None:
        stop_tree(self.proc.pid, timeout)
        self.proc.wait(5)


def spawn(name: str, cmd: list[str], log_path: Path, url: str, env: dict | None = None) -> Server:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)
    return Server(name, proc, url, log_path)


def wait_http(server: Server, path: str, timeout: float, ready=lambda status: status == 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited with code {server.proc.returncode} while starting; "
                               f"log {server.log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + path, timeout=2) as resp:
                status = resp.status
        except urllib.error.HTTPError as err:
            status = err.code
        except OSError:
            status = None
        if status is not None and ready(status):
            return
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s; log {server.log_path}:\n{server.log_tail()}")


def start_engine(model_dir: Path, log_dir: Path, api_key: str | None = None, extra_args: tuple = ()) -> Server:
    port = free_port()
    cmd = [PYTHON, "-m", "engine", "--model", str(model_dir), "--served-model-name", SERVED_NAME,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    server = spawn("engine", cmd, log_dir / f"engine-{port}.log", f"http://127.0.0.1:{port}")
    wait_http(server, "/health", ENGINE_START_TIMEOUT)
    return server


def start_proxy(engine_url: str, log_dir: Path, api_key: str | None = None,
                max_upload_mb: float | None = None, engine_status_file: Path | None = None,
                extra_args: tuple = ()) -> Server:
    port = free_port()
    cmd = [PYTHON, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port), "--engine-url", engine_url,
           "--log-file", str(log_dir / f"proxy-{port}.log")]
    if max_upload_mb is not None:
        cmd += ["--max-upload-mb", str(max_upload_mb)]
    if engine_status_file is not None:
        cmd += ["--engine-status-file", str(engine_status_file)]
    cmd += list(extra_args)
    env = {"ENGINE_API_KEY": api_key or "", "VLLM_API_KEY": ""}  # only the key a test gives, never the shell's
    server = spawn("proxy", cmd, log_dir / f"proxy-{port}.log", f"http://127.0.0.1:{port}", env=env)
    wait_http(server, "/api/health", 30, ready=lambda status: True)  # any answer: the proxy is listening
    return server


def engine_stats(engine: Server) -> dict:
    status, body = http("GET", engine.url + "/stats", timeout=10)
    assert status == 200, body
    return body


def wait_idle(engine: Server, timeout: float = 5.0) -> float:
    """Seconds until the engine runs and queues nothing; fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = engine_stats(engine)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.1)
    pytest.fail(f"engine still busy {timeout}s after the client went away: {engine_stats(engine)}")


def long_generation_tokens(engine: Server, seconds: float = 30.0, cap: int = 3000) -> int:
    """A max_tokens whose generation takes about `seconds` on this machine (timed on a short request), so
    that a test can be sure a stream is still running when it stops reading."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 32,
            "ignore_eos": True, "temperature": 0}
    start = time.monotonic()
    status, reply = http("POST", engine.url + "/v1/chat/completions", body)
    assert status == 200, reply
    per_token = (time.monotonic() - start) / 32
    return max(200, min(cap, int(seconds / per_token)))


# ---- fixtures ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(qwen3_vl_dir, tmp_path_factory):
    """The real engine on the tiny random Qwen3-VL checkpoint, shared by one test module."""
    server = start_engine(qwen3_vl_dir, tmp_path_factory.mktemp("engine-logs"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(engine, tmp_path_factory):
    server = start_proxy(engine.url, tmp_path_factory.mktemp("proxy-logs"))
    yield server
    server.stop()
