"""A compact paged-KV inference engine for Qwen3-VL, Qwen3 and Llama models.

    from engine import LLM, SamplingParams
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import engine.ops` or `python -m engine --help` does not load the whole engine.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
