"""A local stand-in for the Hugging Face Hub, reached through HF_ENDPOINT: the endpoints huggingface_hub's
snapshot_download uses, serving repos the test builds, so that the real client downloads them.

- GET /api/models/{repo}/revision/{rev}: the repo's commit (`sha`) and files;
- GET /api/models/{repo}/tree/{rev}: the file list with sizes, git blob ids and LFS sha256 for weights;
- HEAD and GET /{repo}/resolve/{rev}/{file}: X-Repo-Commit, ETag (X-Linked-Etag / X-Linked-Size for LFS files),
  Content-Length; GET takes a `Range: bytes=N-` (206), which is how the client resumes an interrupted file.
Refusals as the Hub sends them: 404 with X-Error-Code RepoNotFound / RevisionNotFound, 401 GatedRepo for a gated
repo asked without its token. `drop_once` cuts the connection halfway through a file's first GET; `bytes_per_s`
paces every body, so a test can watch a download in progress.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

CHUNK = 64 * 1024


@dataclass
class HubRepo:
    files: dict[str, bytes]
    token: str | None = None            # gated: this bearer token is needed
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            digest = hashlib.sha1(b"".join(k.encode() + v for k, v in sorted(self.files.items())))
            self.commit = digest.hexdigest()

    @classmethod
    def from_dir(cls, folder: Path, **kw) -> HubRepo:
        return cls({p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
                    if p.is_file()}, **kw)


def is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class StandInHub:
    repos: dict[str, HubRepo]
    drop_once: set[str] = field(default_factory=set)   # file names whose first GET is cut off halfway
    bytes_per_s: float | None = None
    gets: list[tuple[str, str | None]] = field(default_factory=list)   # (file, Range header) of each GET

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}/revision/{rev}", self.info)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}", self.tree)
        app.router.add_get("/{owner}/{name}/resolve/{rev}/{path:.+}", self.resolve)   # and HEAD
        return app

    def _repo(self, request: web.Request) -> HubRepo:
        repo_id = f"{request.match_info['owner']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound",
                                            "X-Error-Message": "Repository not found"})
        if repo.token and request.headers.get("Authorization") != f"Bearer {repo.token}":
            raise web.HTTPUnauthorized(headers={"X-Error-Code": "GatedRepo",
                                                "X-Error-Message": "Access to this model is restricted"})
        if request.match_info["rev"] not in ("main", repo.commit):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound",
                                            "X-Error-Message": "Invalid rev id"})
        return repo

    async def info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        return web.json_response({"id": f"{request.match_info['owner']}/{request.match_info['name']}",
                                  "sha": repo.commit, "private": False, "gated": bool(repo.token),
                                  "siblings": [{"rfilename": name} for name in repo.files]})

    async def tree(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        entries = []
        for name, data in repo.files.items():
            entry = {"type": "file", "path": name, "size": len(data), "oid": blob_id(data)}
            if is_lfs(name):
                entry["lfs"] = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        name = request.match_info["path"]
        data = repo.files.get(name)
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        etag = hashlib.sha256(data).hexdigest() if is_lfs(name) else blob_id(data)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if is_lfs(name):
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        if request.method == "HEAD":
            return web.Response(headers=headers | {"Content-Length": str(len(data))})
        start = 0
        ranged = request.headers.get("Range")
        self.gets.append((name, ranged))
        if ranged and ranged.startswith("bytes=") and ranged[6:].split("-")[0].isdigit():
            start = int(ranged[6:].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        response = web.StreamResponse(status=206 if ranged else 200, headers=headers)
        response.content_length = len(body)
        await response.prepare(request)
        cut = len(body) // 2 if name in self.drop_once else None
        self.drop_once.discard(name)
        for offset in range(0, len(body), CHUNK):
            if cut is not None and offset >= cut:
                request.transport.close()        # the connection drops mid-file, as a flaky network does
                return response
            piece = body[offset:offset + CHUNK]
            await response.write(piece)
            if self.bytes_per_s:
                await asyncio.sleep(len(piece) / self.bytes_per_s)
        await response.write_eof()
        return response
