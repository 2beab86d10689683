"""Models from the Hugging Face Hub, on request only: `--model OWNER/NAME[@REVISION]` downloads that repo through
huggingface_hub (the library: its cache layout, a dropped connection resumed with a Range request, HF_TOKEN,
HF_HUB_OFFLINE, HF_ENDPOINT) into the standard cache, then the engine loads the snapshot. A run that was stopped
keeps the files it finished; the next one fetches only the rest.

Two steps, so that what can be refused is refused before anything starts:
- `plan(ref)`: the repo's files and their sizes from its metadata (a dry run of snapshot_download: nothing is
  written), the bytes still missing from the cache, and a disk-space check against them;
- `download(plan, progress)`: the files, with `progress(done_bytes, total_bytes)` as they arrive (the launcher
  prints it and writes it where the page reads it).
Every failure is a HubError whose message is one line that says what to do.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The files the engine reads from a repo (weights, configs, tokenizer, chat template); READMEs, images and other
# formats' weights (.bin, .gguf, ONNX) stay on the Hub.
ENGINE_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
DISK_MARGIN_BYTES = 1 << 30      # left free after the download (the cache's lock and metadata files, the OS)
STALE_PARTIAL_S = 60.0           # a partial file untouched this long belongs to a download that was killed
GB = 1e9
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(Exception):
    """A download that cannot be done, in one line."""


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None = None     # None: the repo's default branch

    @classmethod
    def parse(cls, text: str) -> RepoRef | None:
        """`owner/name` or `owner/name@revision`, unless a file or folder of that name exists here."""
        if not text or Path(text).expanduser().exists() or text.startswith((".", "/", "~")):
            return None
        repo, _, revision = text.partition("@")
        if not REPO_ID.match(repo) or (revision == "" and "@" in text):
            return None
        return cls(repo, revision or None)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class DownloadPlan:
    ref: RepoRef
    snapshot: Path | None       # the cached snapshot, offline (else download() asks the Hub for the commit)
    missing_bytes: int          # still to download
    total_bytes: int            # the engine's files of the repo, in all
    files: int
    commit: str | None = None   # the revision resolved by the dry run: the download fetches that very commit


def endpoint() -> str:
    from huggingface_hub import constants
    return constants.ENDPOINT


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def plan(ref: RepoRef) -> DownloadPlan:
    """What downloading `ref` takes; refuses a repo that does not exist, a gated one, no network, too little
    disk space. With HF_HUB_OFFLINE=1 the repo must be in the cache."""
    from huggingface_hub import snapshot_download
    if offline():
        with hub_errors(ref):
            path = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=ENGINE_FILES,
                                     local_files_only=True)
        return DownloadPlan(ref, Path(path), 0, 0, 0)
    with hub_errors(ref):
        files = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=ENGINE_FILES, dry_run=True)
    if not any(f.filename == "config.json" for f in files):
        raise HubError(f"{ref} has no config.json: it is not a Hugging Face model repo the engine can load")
    missing = sum(f.file_size or 0 for f in files if f.will_download)
    remove_stale_partials(ref)
    check_disk_space(ref, missing, cache_dir())
    return DownloadPlan(ref, None, missing, sum(f.file_size or 0 for f in files), len(files),
                        files[0].commit_hash if files else None)


def remove_stale_partials(ref: RepoRef, idle_s: float = STALE_PARTIAL_S) -> int:
    """Delete the partial files a killed download of `ref` left in the cache (untouched for `idle_s`): bytes
    that no later download reuses, since huggingface_hub writes each attempt to a file of its own (a dropped
    connection within one attempt resumes with a Range request). Returns the bytes freed."""
    blobs = cache_dir() / ("models--" + ref.repo_id.replace("/", "--")) / "blobs"
    freed, now = 0, time.time()
    for partial in blobs.glob("*.incomplete") if blobs.is_dir() else []:
        try:
            st = partial.stat()
            if now - st.st_mtime > idle_s:
                partial.unlink()
                freed += st.st_size
        except OSError:
            pass              # another download finished or removed it meanwhile
    return freed


def cache_dir() -> Path:
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE).expanduser()


def check_disk_space(ref: RepoRef, missing: int, where: Path) -> None:
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if missing + DISK_MARGIN_BYTES > free:
        raise HubError(f"not enough disk space to download {ref}: it needs {missing / GB:.1f} GB (+1 GB to spare) "
                       f"and {existing} has {free / GB:.1f} GB free; free some space or set HF_HUB_CACHE to a "
                       f"folder on a larger disk")


def download(p: DownloadPlan, progress: Callable[[int, int], None]) -> Path:
    """The snapshot folder, every engine file of the repo in it; `progress(done, total)` in bytes as it goes
    (done starts at the files an earlier, stopped run finished)."""
    if p.snapshot is not None:
        return p.snapshot
    from huggingface_hub import snapshot_download
    already = p.total_bytes - p.missing_bytes
    with hub_errors(p.ref):
        path = snapshot_download(p.ref.repo_id, revision=p.commit or p.ref.revision, allow_patterns=ENGINE_FILES,
                                 tqdm_class=byte_counter(lambda n: progress(already + n, p.total_bytes)))
    progress(p.total_bytes, p.total_bytes)
    return Path(path)


def byte_counter(on_bytes: Callable[[int], None]):
    """A tqdm class for snapshot_download that shows nothing and reports the bytes written so far: its
    "Reconstructing" bar sums every file's bytes (huggingface_hub's own aggregation over its download threads)."""
    from tqdm.auto import tqdm

    class ByteCounter(tqdm):
        def __init__(self, *args, **kwargs):
            self.counts_bytes = kwargs.get("unit") == "B" and str(kwargs.get("desc", "")).startswith("Reconstruct")
            kwargs.pop("name", None)
            kwargs["file"] = open(os.devnull, "w")    # noqa: SIM115 (closed with the bar)
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            shown = super().update(n)
            if self.counts_bytes:
                on_bytes(int(self.n))
            return shown

        def close(self):
            super().close()
            self.fp.close()

    return ByteCounter


class hub_errors:
    """Turns huggingface_hub's and the network's exceptions into a HubError of one line."""

    def __init__(self, ref: RepoRef):
        self.ref = ref

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or isinstance(err, HubError):
            return False
        message = explain(self.ref, err)
        if message is None:
            return False
        raise HubError(message) from err


def explain(ref: RepoRef, err: BaseException) -> str | None:
    """The one-line reason for `err` (or what caused it), or None for an error that is not the Hub's (a bug:
    raised as it is)."""
    import httpx2
    from huggingface_hub import errors
    chain = []
    while err is not None and len(chain) < 8:
        chain.append(err)
        err = err.__cause__ or err.__context__
    first = lambda *kinds: next((e for e in chain if isinstance(e, kinds)), None)   # noqa: E731
    where = endpoint()
    if first(errors.GatedRepoError):
        return (f"{ref.repo_id} is gated: accept its terms on {where}/{ref.repo_id} while logged in, then set "
                f"HF_TOKEN to an access token of that account")
    if first(errors.RevisionNotFoundError):
        return f"{ref.repo_id} has no revision {ref.revision!r} on {where}: check the branch, tag or commit after @"
    if first(errors.RepositoryNotFoundError):
        return (f"{ref.repo_id} was not found on {where}: check the repo id (owner/name); a private repo needs "
                f"HF_TOKEN set to a token that can read it")
    http = first(errors.HfHubHTTPError)
    if http is not None and http.response is not None:
        status = http.response.status_code
        if status in (401, 403):
            return (f"{where} refused access to {ref.repo_id} ({status}): check HF_TOKEN (a token that can read "
                    f"this repo)")
        return f"{where} answered {status} for {ref.repo_id}: try again later"
    if offline() and first(errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError):
        return (f"{ref} is not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE=1 forbids downloading "
                f"it: unset HF_HUB_OFFLINE to download it")
    full = first(OSError)
    if full is not None and full.errno == 28:
        return f"the disk filled up while downloading {ref}: free some space and run again (the download resumes)"
    if first(httpx2.TransportError, errors.LocalEntryNotFoundError, errors.DryRunError, ConnectionError,
             TimeoutError):
        return (f"cannot reach {where} to download {ref}: check the network connection (or, for a model already "
                f"in the cache, set HF_HUB_OFFLINE=1)")
    return None


def fetch_advice(card: tuple[str, int] | None) -> list[str]:
    """Which Hub checkpoint fits this GPU and the one command that fetches and runs it (nothing is downloaded
    unasked)."""
    from app.checkpoints import hub_suggestion
    from app.models import TARGET_NAME, TARGET_REPO
    if card is None:
        return [f"To use {TARGET_NAME}:  ./run_app.sh --model /path/to/{TARGET_NAME}   (or set MODEL_PATH), or "
                f"download it: ./run_app.sh --model {TARGET_REPO}"]
    choice = hub_suggestion(card)
    pick = choice.checkpoint
    return [f"For this GPU: {pick.repo} ({pick.fmt.name}, ~{pick.weights / 1e9:.1f} GB of weights): "
            f"{choice.reason}.",
            f"To download it once into the Hugging Face cache and run it:  ./run_app.sh --model {pick.repo}"]


class TerminalProgress:
    """"Downloading model… 43%, 2.1 of 5.0 GB" on one line that updates in a terminal, or a line per tenth
    elsewhere (a log file), and at the end."""

    def __init__(self, ref: RepoRef, out=sys.stdout, interval_s: float = 0.5):
        self.ref, self.out, self.interval_s = ref, out, interval_s
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.last_time, self.last_tenth = 0.0, -1

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        tenth = int(10 * done / total) if total else 10
        finished = done >= total
        if self.tty and (finished or now - self.last_time >= self.interval_s):
            self.out.write(f"\r[app] {describe_progress(done, total)} ({self.ref})" + ("\n" if finished else ""))
            self.out.flush()
            self.last_time = now
        elif not self.tty and tenth > self.last_tenth:
            self.out.write(f"[app] {describe_progress(done, total)} ({self.ref})\n")
            self.out.flush()
            self.last_tenth = tenth


def describe_progress(done: int, total: int) -> str:
    """As the page says it (static/status.js): "Downloading model… 43%, 2.1 of 5.0 GB" (MB below a GB)."""
    pct = int(100 * done / total) if total else 100
    return f"Downloading model… {pct}%, {sizes(done, total)}"


def sizes(done: int, total: int) -> str:
    scale, unit = (GB, "GB") if total >= GB else (1e6, "MB")
    return f"{done / scale:.1f} of {total / scale:.1f} {unit}"
