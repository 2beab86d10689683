"""What the chat page asks the proxy itself: the engine's state (always 200), the proxy's limits, and which
libraries web/install_vendor.sh put into static/vendor/, so the page loads only those that exist."""
from __future__ import annotations

from aiohttp import web

from proxy.config import CONFIG

# library name -> files under static/vendor/ it needs
VENDOR_FILES = {
    "marked": ("marked.esm.js",),
    "dompurify": ("purify.es.mjs",),
    "highlight": ("highlight.min.mjs", "hljs-light.css", "hljs-dark.css"),
    "katex": ("katex/katex.mjs", "katex/katex.min.css"),
    "pdfjs": ("pdfjs/pdf.min.mjs", "pdfjs/pdf.worker.min.mjs"),
}


def available_vendor(static_dir) -> list[str]:
    vendor = static_dir / "vendor"
    return [name for name, files in VENDOR_FILES.items() if all((vendor / f).is_file() for f in files)]


async def page_status(request: web.Request) -> web.Response:
    """/api/health's answer, always with status 200 (the page polls this while the engine loads or is down, and
    an expected "not ready" must not read as a failed request in the browser's console)."""
    from proxy.server import health     # the one definition of "ready"; imported late: server.py imports us
    answer = await health(request)
    return web.Response(body=answer.body, content_type="application/json", headers={"Cache-Control": "no-store"})


async def page_config(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"max_upload_bytes": cfg.max_upload_bytes, "vendor": available_vendor(cfg.static_dir)},
                             headers={"Cache-Control": "no-cache"})


def add_page_routes(app: web.Application) -> None:
    app.router.add_get("/api/page-config", page_config)
    app.router.add_get("/api/status", page_status)
