"""--speculative-config: vLLM's keys and meanings, parsed once into a typed dataclass."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

METHODS = ("ngram", "eagle3")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 3        # ngram: the shortest suffix of the context looked up earlier in it
    prompt_lookup_max: int = 5        # ngram: the longest
    model: str | None = None          # eagle3: the draft head's directory
    # Speculation stops while this many requests or more run: a large batch is compute-bound, where a verify
    # step's extra tokens cost more than the tokens they save (vLLM's name).
    disable_by_batch_size: int = 8

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        """From the CLI's JSON (or LLM(speculative_config=...)); ValueError names the key to fix."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, not {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, not {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required (the draft tokens per step)")
        config = cls(**value)
        config._check()
        return config

    def _check(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a whole number >= 1, not {v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"not {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "eagle3":
            if not self.model:
                raise ValueError("speculative_config.model is required for eagle3: the draft head's directory")
            if not (Path(self.model) / "config.json").is_file():
                raise ValueError(f"speculative_config.model {self.model!r} is not a draft-head directory "
                                 f"(no config.json in it)")
        elif self.model is not None:
            raise ValueError("speculative_config.model is only for eagle3 (ngram drafts from the context)")
