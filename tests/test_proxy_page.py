"""The proxy's routes for the page: /api/status (always 200), the engine's load progress while it starts,
/api/page-config; and the engine side of the progress (engine.load_progress)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from aiohttp.test_utils import TestClient, TestServer

from engine import load_progress
from proxy.config import ProxyConfig
from proxy.server import create_app
from servers import REPO, free_port


def get(cfg: ProxyConfig, path: str) -> tuple[int, dict]:
    async def run():
        async with TestClient(TestServer(create_app(cfg))) as client:
            resp = await client.get(path)
            return resp.status, await resp.json()
    return asyncio.run(run())


def config(tmp_path, status_file=None) -> ProxyConfig:
    static = tmp_path / "static"
    (static / "vendor" / "katex").mkdir(parents=True, exist_ok=True)
    (static / "chat.html").write_text("<!doctype html>")
    return ProxyConfig(engine_url=f"http://127.0.0.1:{free_port()}", static_dir=static,
                       engine_status_file=status_file, max_upload_bytes=1234)


def test_health_reports_load_progress_of_a_live_engine_process(tmp_path):
    status_file = tmp_path / "engine-load.json"
    load_progress.start(str(status_file))
    try:
        load_progress.weights(5, 10)
        status, body = get(config(tmp_path, status_file), "/api/health")
        assert status == 503
        assert body["engine"] == "starting" and body["phase"] == "loading weights"
        assert body["progress"] == 0.45     # halfway through the weights: 0.05 + (0.85 - 0.05) / 2
        assert body["error"]["code"] == "engine_starting" and "loading weights, 45%" in body["error"]["message"]
        # The page's own route says the same with status 200.
        status, body = get(config(tmp_path, status_file), "/api/status")
        assert status == 200 and body["engine"] == "starting"
    finally:
        load_progress.start(None)


def test_a_status_file_left_by_a_dead_engine_is_ignored(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    status_file = tmp_path / "engine-load.json"
    status_file.write_text(json.dumps({"pid": int(dead.stdout), "phase": "loading weights", "progress": 0.5}))
    status, body = get(config(tmp_path, status_file), "/api/status")
    assert status == 200 and body["engine"] == "unreachable"
    status_file.write_text("{not json")
    assert get(config(tmp_path, status_file), "/api/status")[1]["engine"] == "unreachable"


def test_page_config_lists_only_the_vendor_libraries_present(tmp_path):
    cfg = config(tmp_path)
    vendor = cfg.static_dir / "vendor"
    for name in ("marked.esm.js", "purify.es.mjs", "katex/katex.mjs"):   # katex's stylesheet is missing
        (vendor / name).write_text("")
    (vendor / "pdfjs").mkdir()
    (vendor / "pdfjs" / "pdf.min.mjs").write_text("")                    # pdf.js without its worker
    status, body = get(cfg, "/api/page-config")
    assert status == 200 and body == {"max_upload_bytes": 1234, "vendor": ["marked", "dompurify"]}
    (vendor / "pdfjs" / "pdf.worker.min.mjs").write_text("")
    assert get(cfg, "/api/page-config")[1]["vendor"] == ["marked", "dompurify", "pdfjs"]


def test_engine_flag_writes_progress_before_torch_is_imported(tmp_path):
    status_file = tmp_path / "load.json"
    code = ("import sys; from engine.server.cli import parse_args; from engine import load_progress; "
            f"_, a = parse_args(['--model', 'x', '--load-status-file', {str(status_file)!r}]); "
            "load_progress.start(a.load_status_file); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    body = json.loads(status_file.read_text())
    assert body["phase"] == "starting" and body["progress"] == 0.0 and body["pid"] > 0


def test_a_chat_request_while_the_engine_loads_says_loading_not_unreachable(tmp_path):
    status_file = tmp_path / "engine-load.json"
    status_file.write_text(json.dumps({"pid": os.getpid(), "phase": "loading weights", "progress": 0.3}))

    async def run():
        async with TestClient(TestServer(create_app(config(tmp_path, status_file)))) as client:
            resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            return resp.status, await resp.json()
    status, body = asyncio.run(run())
    assert status == 503 and body["error"]["code"] == "engine_starting"
    assert "loading the model (loading weights, 30%)" in body["error"]["message"]
    assert "engine" not in body                   # the page's status fields only on /api/status


def test_an_engine_that_started_but_does_not_answer_is_unresponsive(tmp_path):
    import socket
    status_file = tmp_path / "engine-load.json"
    status_file.write_text(json.dumps({"pid": os.getpid(), "phase": "ready", "progress": 1.0}))
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)                                 # accepts connections, never answers
    try:
        cfg = config(tmp_path, status_file)
        cfg = ProxyConfig(**{**cfg.__dict__, "engine_url": f"http://127.0.0.1:{hung.getsockname()[1]}",
                             "health_timeout": 0.5})
        status, body = get(cfg, "/api/status")
    finally:
        hung.close()
    assert status == 200 and body["engine"] == "unresponsive" and body["error"]["code"] == "engine_unresponsive"
