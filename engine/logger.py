"""vLLM-style log lines: `INFO 01-24 10:23:42 [model_runner.py:218] message`, to stderr and optionally a file."""
from __future__ import annotations

import logging
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"
_ROOT = "engine"


def _root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def init_logger(name: str) -> logging.Logger:
    _root()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def add_log_file(path: str) -> None:
    """Also write every engine log line to `path` (appending), e.g. vllm.log."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    _root().addHandler(handler)
