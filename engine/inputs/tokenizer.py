"""Load the model's tokenizer from a Hugging Face directory or from a GGUF file's metadata.

transformers does the work (AutoTokenizer reads tokenizer.json / tokenizer_config.json, or converts the GGUF
vocabulary into a fast tokenizer); this file only turns "where is the model" into a clear error when it is missing.
Nothing is fetched from a model hub: a path that does not exist is an error, never a hub id.
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of `model`: a Hugging Face model directory or a `.gguf` file."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist; pass a Hugging Face model directory "
                             f"or a .gguf file", code="model_not_found")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model directory",
                                 code="model_not_found")
        return _load(path.parent, gguf_file=path.name)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer (looked for {', '.join(_TOKENIZER_FILES)})",
                             code="model_not_found")
    return _load(path)


def _load(directory: Path, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    where = directory / gguf_file if gguf_file else directory
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    except ImportError as e:
        # transformers reads GGUF metadata through the `gguf` package, an optional dependency of its own.
        raise ModelLoadError(f"cannot read the tokenizer of {where}: {e} (pip install gguf)") from e
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... for bad files
        raise ModelLoadError(f"cannot load the tokenizer of {where}: {type(e).__name__}: {e}") from e
