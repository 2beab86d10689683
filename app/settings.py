"""Ports, addresses and file locations shared by the launcher and the shell scripts (all from the environment)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Settings:
    engine_host: str
    engine_port: int
    proxy_host: str
    proxy_port: int
    log_dir: Path            # vllm.log, proxy.log, launcher.log
    run_dir: Path            # pid files and state.json of the running app
    engine_start_timeout: float
    python: str = sys.executable

    @classmethod
    def from_env(cls, env=os.environ) -> "Settings":
        return cls(
            engine_host=env.get("ENGINE_HOST", "127.0.0.1"),
            engine_port=int(env.get("ENGINE_PORT", "3001")),
            proxy_host=env.get("PROXY_HOST", "127.0.0.1"),
            proxy_port=int(env.get("PROXY_PORT", "8000")),
            log_dir=Path(env.get("LOCALCHAT_LOG_DIR", REPO)).resolve(),
            run_dir=Path(env.get("LOCALCHAT_RUN_DIR", REPO / ".run")).resolve(),
            # Loading an 8B model from a slow disk on CPU can take many minutes; a hang should still end.
            engine_start_timeout=float(env.get("ENGINE_START_TIMEOUT", "1800")),
        )

    @property
    def engine_url(self) -> str:
        return f"http://{_connect_host(self.engine_host)}:{self.engine_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://{_connect_host(self.proxy_host)}:{self.proxy_port}"

    @property
    def engine_log(self) -> Path:
        return self.log_dir / "vllm.log"

    @property
    def proxy_log(self) -> Path:
        return self.log_dir / "proxy.log"

    @property
    def launcher_log(self) -> Path:
        return self.log_dir / "launcher.log"

    @property
    def static_dir(self) -> Path:
        return REPO / "static"


def _connect_host(host: str) -> str:
    """The address to connect to for a listen address: a wildcard listen is reached on loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
