"""The launcher keeps the engine up: a dead engine is restarted with back-off while the proxy keeps serving the
page and answers 503 "restarting"; a crash loop ends after ENGINE_MAX_RESTARTS with a clear message."""
from __future__ import annotations

import http.client as httpclient
import json
import signal
import time
from pathlib import Path

import psutil
import pytest

from app.supervision import EngineStatusFile, EngineWatch, RestartPolicy, describe_exit
from servers import http
from test_app_launcher import PYTHON, app_env, assert_all_gone, start_app, tree  # noqa: F401


class FakeEngine:
    """A Popen stand-in: alive until `die(code)`."""

    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode

    def die(self, code: int) -> None:
        self.returncode = code

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_watch(tmp_path, healthy=lambda: True, **policy):
    started: list[FakeEngine] = []

    def start() -> FakeEngine:
        started.append(FakeEngine())
        return started[-1]
    clock, lines = Clock(), []
    status = EngineStatusFile(tmp_path / "engine_status.json")
    watch = EngineWatch(start, healthy, RestartPolicy(**policy), status, tmp_path / "vllm.log", lines.append, clock)
    watch.attach(FakeEngine())
    return watch, started, clock, lines, status


def test_a_dead_engine_is_restarted_after_a_back_off(tmp_path):
    watch, started, clock, lines, status = make_watch(tmp_path, backoff_s=2.0)
    watch.engine.die(-signal.SIGKILL)
    watch.poll()
    state = json.loads(status.path.read_text())
    assert state["state"] == "restarting" and "killed by SIGKILL" in state["message"]
    clock.now = 1.9
    watch.poll()
    assert not started                                   # still backing off
    clock.now = 2.0
    watch.poll()
    assert len(started) == 1 and watch.state == "starting"
    watch.poll()
    assert watch.state == "running" and not status.path.exists()
    assert "killed by SIGKILL" in (tmp_path / "vllm.log").read_text()


def test_back_off_doubles_and_a_crash_loop_gives_up(tmp_path):
    watch, started, clock, lines, status = make_watch(tmp_path, max_restarts=3, backoff_s=1.0)
    waits = []
    for _ in range(4):
        watch.engine.die(1)
        watch.poll()
        if watch.state == "failed":
            break
        waits.append(watch.restart_at - clock.now)
        clock.now = watch.restart_at
        watch.poll()                                     # restarted
        watch.engine.die(1)                              # and dies while starting
        watch.poll()
        waits.append(watch.restart_at - clock.now)
        clock.now = watch.restart_at
        watch.poll()
        watch.poll()                                     # healthy again, but crashes count on
        if watch.state == "failed":
            break
    assert watch.state == "failed"
    assert waits[:3] == [1.0, 2.0, 4.0]
    state = json.loads(status.path.read_text())
    assert state["state"] == "failed" and "stopped restarting" in state["message"]
    assert len(started) == 3


def test_a_stable_engine_starts_the_count_over(tmp_path):
    watch, started, clock, lines, status = make_watch(tmp_path, max_restarts=1, stable_s=60)
    watch.engine.die(1)
    watch.poll()
    clock.now = watch.restart_at
    watch.poll()
    watch.poll()
    assert watch.state == "running" and watch.crashes == 1
    clock.now += 61
    watch.poll()
    watch.engine.die(1)
    watch.poll()
    assert watch.state == "backoff"                       # not failed: the earlier crash no longer counts


def test_exit_descriptions():
    assert describe_exit(3) == "exited with code 3"
    assert "SIGTERM" in describe_exit(-15) and "out-of-memory" in describe_exit(-9)


# ---- the real launcher, engine and proxy ------------------------------------------------------------------
def stream_until_cut(proxy_url: str, engine: psutil.Process) -> list[str]:
    """Open a long stream through the proxy, SIGKILL the engine after its first event, read to the end."""
    host, port = proxy_url.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = []
    while line := resp.readline():
        if line.startswith(b"data:"):
            events.append(line[5:].strip().decode())
            if len(events) == 1:
                engine.send_signal(signal.SIGKILL)
    return events


@pytest.mark.slow
def test_a_killed_engine_is_restarted_and_the_page_keeps_working(qwen3_vl_dir, app_env, tmp_path):
    env = {**app_env, "ENGINE_RESTART_BACKOFF": "0.5"}
    launcher, out = start_app([PYTHON, "-m", "app", "start", "--model", str(qwen3_vl_dir)], env, tmp_path)
    proxy_url = f"http://127.0.0.1:{env['PROXY_PORT']}"
    try:
        engine = next(p for p in tree(launcher.pid) if "-m engine" in " ".join(p.cmdline()))
        events = stream_until_cut(proxy_url, engine)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        # Within a poll of the launcher, the proxy says why the engine does not answer.
        deadline = time.monotonic() + 3
        while (health := http("GET", proxy_url + "/api/health"))[1].get("engine") != "restarting":
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert health[0] == 503 and "killed by SIGKILL" in health[1]["error"]["message"]
        status, page = http("GET", proxy_url + "/")             # the page is still served
        assert status == 200
        deadline = time.monotonic() + 240
        while http("GET", proxy_url + "/api/health")[0] != 200:
            assert launcher.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.3)
        status, reply = http("POST", proxy_url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert status == 200, reply
        log = (Path(env["LOCALCHAT_LOG_DIR"]) / "vllm.log").read_text()
        assert "killed by SIGKILL" in log
        deadline = time.monotonic() + 5       # the launcher notices within a poll of the engine's /health
        while "back after restart 1" not in out.read_text():
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
    finally:
        procs = tree(launcher.pid)
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
        assert_all_gone(procs)
