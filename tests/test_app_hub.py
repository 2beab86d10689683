"""Models from the Hub on request (app/hub.py): `./run_app.sh --model OWNER/NAME[@REV]` downloads through the real
huggingface_hub client from a local stand-in for the Hub (tests/hub_server.py, reached through HF_ENDPOINT) that
serves a tiny Qwen3-VL the test builds; the engine then serves it. Refusals (wrong id, gated, no network, offline,
no disk space) are one line and exit code 1, before anything starts; an interrupted download resumes."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from browser_helpers import browser  # noqa: F401 (the browser test's fixture)
from hub_server import HubRepo, StandInHub
from servers import PYTHON, REPO, free_port, http

REPO_ID = "Tiny/Qwen3-VL-tiny"
TOKEN = "hf_test_token"


class HubThread:
    """The stand-in Hub on its own event loop in a thread, for the duration of a test."""

    def __init__(self, hub: StandInHub):
        self.hub, self.port = hub, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.hub.app())
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def tiny_repo(qwen3_vl_dir) -> HubRepo:
    return HubRepo.from_dir(qwen3_vl_dir)


@pytest.fixture
def stand_in(tiny_repo):
    server = HubThread(StandInHub({REPO_ID: tiny_repo, "Gated/Qwen3-VL-tiny": HubRepo(tiny_repo.files, token=TOKEN)}))
    yield server
    server.stop()


def hub_env(tmp_path: Path, endpoint: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "MODEL_PATH"}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "ENGINE_PORT": str(free_port()), "PROXY_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
            "LOCALCHAT_LOG_DIR": str(tmp_path / "logs"), "LOCALCHAT_RUN_DIR": str(tmp_path / "run"),
            "LOCALCHAT_FIT": "0", **more}


def launch(env: dict[str, str], model: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "app", "start", "--model", model], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def snapshot_of(env: dict[str, str], repo: HubRepo, repo_id: str = REPO_ID) -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / repo.commit


# ---- the repo id --------------------------------------------------------------------------------------------
def test_a_repo_id_is_owner_slash_name_with_an_optional_revision(tmp_path, monkeypatch):
    from app.hub import RepoRef
    assert RepoRef.parse("Qwen/Qwen3-VL-8B-Instruct-AWQ") == RepoRef("Qwen/Qwen3-VL-8B-Instruct-AWQ")
    assert RepoRef.parse("Qwen/Qwen3-VL-8B-Instruct@v1.0") == RepoRef("Qwen/Qwen3-VL-8B-Instruct", "v1.0")
    for not_an_id in ("model.gguf", "/models/qwen", "./a/b", "~/a/b", "a/b/c", "a/b@", "Qwen", ""):
        assert RepoRef.parse(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    assert RepoRef.parse("models/qwen") is None          # a folder of that name here is a path


def test_the_disk_space_check_counts_what_is_missing(tmp_path, monkeypatch):
    from app import hub
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda where: type("U", (), {"free": 3 * 10**9})())
    hub.check_disk_space(hub.RepoRef("a/b"), int(1.5e9), tmp_path / "not" / "yet")      # 1.5 + 1 GB <= 3 GB
    with pytest.raises(hub.HubError, match=r"needs 2\.5 GB \(\+1 GB to spare\) and .* has 3\.0 GB free; .*HF_HUB_CACHE"):
        hub.check_disk_space(hub.RepoRef("a/b"), int(2.5e9), tmp_path)


# ---- refusals: one line, exit code 1, nothing started ---------------------------------------------------------
@pytest.mark.parametrize("case", ["wrong id", "gated", "wrong revision", "no network", "offline"])
def test_a_model_that_cannot_be_fetched_is_one_clear_line(case, stand_in, tmp_path):
    endpoint = stand_in.url if case != "no network" else f"http://127.0.0.1:{free_port()}"
    model = {"wrong id": "Tiny/No-Such-Model", "gated": "Gated/Qwen3-VL-tiny",
             "wrong revision": f"{REPO_ID}@no-such-branch"}.get(case, REPO_ID)
    env = hub_env(tmp_path, endpoint, **({"HF_HUB_OFFLINE": "1"} if case == "offline" else {}))
    run = launch(env, model, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("[app] error: "), run.stdout
    assert not run.stderr.strip(), run.stderr
    want = {"wrong id": "Tiny/No-Such-Model was not found on http://127.0.0.1",
            "gated": "Gated/Qwen3-VL-tiny is gated: accept its terms",
            "wrong revision": "has no revision 'no-such-branch'",
            "no network": "cannot reach http://127.0.0.1",
            "offline": "is not in the Hugging Face cache"}[case]
    assert want in lines[0], lines[0]
    assert not (tmp_path / "logs" / "proxy.log").exists()          # refused before the proxy started


# ---- downloading and serving ----------------------------------------------------------------------------------
def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow
def test_the_launcher_downloads_the_repo_past_a_cut_connection_and_the_engine_serves_it(stand_in, tiny_repo, tmp_path):
    # The weights' connection drops halfway through the first time: huggingface_hub asks again (from the bytes it
    # had written: test_a_dropped_connection_resumes_where_it_was; here none, its 10 MB chunk was not full).
    [weights] = [name for name in tiny_repo.files if name.endswith(".safetensors")]
    stand_in.hub.drop_once.add(weights)
    env = hub_env(tmp_path, stand_in.url, HF_TOKEN=TOKEN)          # the gated copy: HF_TOKEN is sent
    out = tmp_path / "launcher.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([PYTHON, "-m", "app", "start", "--model", "Gated/Qwen3-VL-tiny"], cwd=REPO, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        state = Path(env["LOCALCHAT_RUN_DIR"]) / "state.json"
        wait_for(lambda: proc.poll() is not None or (state.exists() and '"ready"' in state.read_text()), 300,
                 "the app to start")
        assert proc.poll() is None, out.read_text()
        text = out.read_text()
        assert "downloading Gated/Qwen3-VL-tiny from http://127.0.0.1" in text, text
        assert "Downloading model… 100%" in text
        assert [name for name, _ in stand_in.hub.gets].count(weights) == 2
        snap = snapshot_of(env, tiny_repo, "Gated/Qwen3-VL-tiny")
        assert (snap / weights).read_bytes() == tiny_repo.files[weights]
        assert not list(snap.glob("*.md"))
        status, models = http("GET", f"http://127.0.0.1:{env['PROXY_PORT']}/v1/models")
        assert status == 200 and models["data"][0]["id"] == "Qwen3-VL-tiny"
        status, answer = http("POST", f"http://127.0.0.1:{env['PROXY_PORT']}/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    # Offline, the cached snapshot is used without asking the Hub (which is gone too).
    stand_in.stop()
    code = ("from app import hub; p = hub.plan(hub.RepoRef('Gated/Qwen3-VL-tiny')); "
            "print(p.snapshot, p.missing_bytes)")
    run = subprocess.run([PYTHON, "-c", code], cwd=REPO, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=60)
    assert run.stdout.split() == [str(snap), "0"], run.stdout + run.stderr


# huggingface_hub writes a file in 10 MB chunks; the tiny weights are 1.5 MB, so chunks of 64 KB here.
DOWNLOAD = ("import sys; from huggingface_hub import constants; constants.DOWNLOAD_CHUNK_SIZE = 1 << 16; "
            "from app import hub; p = hub.plan(hub.RepoRef(sys.argv[1])); "
            "print(hub.download(p, lambda done, total: None))")


def test_a_dropped_connection_resumes_where_it_was(stand_in, tiny_repo, tmp_path):
    [weights] = [name for name in tiny_repo.files if name.endswith(".safetensors")]
    stand_in.hub.drop_once.add(weights)
    env = hub_env(tmp_path, stand_in.url)
    run = subprocess.run([PYTHON, "-c", DOWNLOAD, REPO_ID], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    first, again = [ranged for name, ranged in stand_in.hub.gets if name == weights]
    size = len(tiny_repo.files[weights])           # cut about halfway: the second request asks for the rest only
    assert first is None and again.startswith("bytes=") and size // 2 <= int(again[6:-1]) < size, again
    assert (snapshot_of(env, tiny_repo) / weights).read_bytes() == tiny_repo.files[weights]


def test_a_run_killed_midway_keeps_its_finished_files_and_the_next_run_completes(stand_in, tiny_repo, tmp_path):
    [weights] = [name for name in tiny_repo.files if name.endswith(".safetensors")]
    size = len(tiny_repo.files[weights])
    stand_in.hub.bytes_per_s = size / 4          # about 4 s for the weights: time to kill the run halfway
    env = hub_env(tmp_path, stand_in.url)
    first = subprocess.Popen([PYTHON, "-c", DOWNLOAD, REPO_ID], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    blobs = Path(env["HF_HOME"]) / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "blobs"
    partial = wait_for(lambda: [p for p in blobs.glob("*.incomplete") if p.stat().st_size > size // 4], 60,
                       "a partly written weights file")
    first.kill()
    first.wait(10)
    os.utime(partial[0], (time.time() - 120, time.time() - 120))      # left untouched since (a killed run's)
    stand_in.hub.bytes_per_s = None
    stand_in.hub.gets.clear()
    second = subprocess.run([PYTHON, "-c", DOWNLOAD, REPO_ID], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.split()[-1]) == snapshot_of(env, tiny_repo)
    fetched = {name for name, _ in stand_in.hub.gets}
    assert weights in fetched and fetched < set(tiny_repo.files)   # the small files finished in the first run
    assert (snapshot_of(env, tiny_repo) / weights).read_bytes() == tiny_repo.files[weights]
    assert not list(blobs.glob("*.incomplete"))                  # the killed run's partial file is gone


def test_the_progress_reaches_the_terminal_and_the_status_file(tmp_path):
    import io

    from app.hub import RepoRef, TerminalProgress, describe_progress
    from engine import load_progress
    assert describe_progress(2_150_000_000, 5_000_000_000) == "Downloading model… 43%, 2.1 of 5.0 GB"
    assert describe_progress(3_200_000, 9_800_000) == "Downloading model… 32%, 3.2 of 9.8 MB"
    log = io.StringIO()                       # not a terminal: a line per tenth, and the last one
    show = TerminalProgress(RepoRef("a/b"), out=log)
    for done in range(0, 101, 5):
        show(done, 100)
    assert len(log.getvalue().splitlines()) == 11 and log.getvalue().splitlines()[-1].startswith(
        "[app] Downloading model… 100%")
    status = tmp_path / "engine-load.json"
    load_progress.start(str(status))
    load_progress.downloading(2_150_000_000, 5_000_000_000)
    body = json.loads(status.read_text())
    assert body["phase"] == "downloading" and body["progress"] == 0.43 and body["pid"] == os.getpid()
    assert (body["downloaded_bytes"], body["total_bytes"]) == (2_150_000_000, 5_000_000_000)
    load_progress.start(None)


def test_with_a_gpu_and_no_model_the_launcher_names_the_checkpoint_that_fits_and_downloads_nothing():
    from app.hub import fetch_advice
    GiB = 1 << 30
    for gib, repo in ((8, "Qwen/Qwen3-VL-8B-Instruct-AWQ"), (12, "Qwen/Qwen3-VL-8B-Instruct-AWQ"),
                      (16, "Qwen/Qwen3-VL-8B-Instruct-FP8"), (24, "Qwen/Qwen3-VL-8B-Instruct")):
        which, command = fetch_advice((f"a {gib} GiB card", gib * GiB))
        assert which.startswith(f"For this GPU: {repo} ("), (gib, which)
        assert command.endswith(f"./run_app.sh --model {repo}")
    [no_gpu] = fetch_advice(None)
    assert "./run_app.sh --model Qwen/Qwen3-VL-8B-Instruct" in no_gpu


@pytest.mark.browser
@pytest.mark.slow
def test_the_page_shows_the_download_progress(stand_in, tiny_repo, tmp_path, browser):
    from browser_helpers import expect, new_page
    stand_in.hub.bytes_per_s = len(tiny_repo.files["model.safetensors"]) / 8    # about 8 s of download
    env = hub_env(tmp_path, stand_in.url)
    with open(tmp_path / "launcher.out", "wb") as f:
        proc = subprocess.Popen([PYTHON, "-m", "app", "start", "--model", REPO_ID], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    context, page, errors = new_page(browser)
    try:
        proxy_url = f"http://127.0.0.1:{env['PROXY_PORT']}"
        from app.procs import http_status
        wait_for(lambda: proc.poll() is not None or http_status(proxy_url + "/api/health", 1.0) is not None, 60,
                 "the proxy")
        assert proc.poll() is None, (tmp_path / "launcher.out").read_text()
        page.goto(proxy_url + "/")
        status = page.locator("#status")
        expect(status).to_have_attribute("data-state", "starting", timeout=30_000)
        expect(status.locator(".status-text")).to_have_text(
            re.compile(r"^Downloading model… \d{1,3}%, \d+\.\d of 1\.6 MB$"), timeout=10_000)
        expect(status).to_have_attribute("data-state", "ready", timeout=240_000)    # then the engine loads it
        expect(page.locator("#model-name")).to_have_text("Qwen3-VL-tiny")
    finally:
        page.goto("about:blank")
        context.close()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    assert not errors, f"errors on the page: {errors}"


def test_the_demo_notice_names_that_checkpoint_and_its_command(capsys, smollm2_gguf):
    from app.launcher import demo_notice
    from app.models import ResolvedModel
    demo_notice(ResolvedModel(smollm2_gguf, "built-in demo", "SmolLM2-135M-Instruct", demo=True),
                gpu=lambda: ("NVIDIA GeForce RTX 4070", 12 << 30))
    out = capsys.readouterr().out
    assert "[app] For this GPU: Qwen/Qwen3-VL-8B-Instruct-AWQ (awq 4-bit g128, ~7.3 GB of weights): the most " \
           "precise one that fits NVIDIA GeForce RTX 4070 (12 GiB" in out
    assert "[app] To download it once into the Hugging Face cache and run it:  ./run_app.sh --model " \
           "Qwen/Qwen3-VL-8B-Instruct-AWQ" in out
