"""What a checkpoint's `quantization_config` says, as typed schemes: which linear layers hold quantized weights
and in which form. Methods and names are vLLM's (`--quantization fp8 | awq | gptq | compressed-tensors`).

A scheme describes the in-memory form of one linear layer: `WNA16Scheme` (N-bit integer weights in groups along
the input dimension, 16-bit activations) or `Fp8BlockScheme` (e4m3 weights with one scale per block). Layers that
no scheme targets, or that an ignore list names, stay in the model dtype."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.errors import ModelLoadError

METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
# vLLM's other names for the same checkpoints (kernel choices there; one kernel per format here).
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}


@dataclass(frozen=True)
class WNA16Scheme:
    bits: int                  # 4 or 8
    group_size: int            # -1: one group over the whole input dimension (per-channel)
    symmetric: bool            # zero point fixed at 2**(bits-1) (no zero-point tensor in the checkpoint)
    act_order: bool = False    # the checkpoint may carry a g_idx that permutes the input dimension

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.bits}-bit, {group}" + ("" if self.symmetric else ", zero points") + \
            (", act-order" if self.act_order else "")


@dataclass(frozen=True)
class Fp8BlockScheme:
    block_size: tuple[int, int]   # (rows of output, columns of input) per scale

    def describe(self) -> str:
        return f"e4m3, {self.block_size[0]}x{self.block_size[1]} blocks"


Scheme = WNA16Scheme | Fp8BlockScheme


@dataclass
class QuantizationConfig:
    method: str                                             # one of METHODS
    groups: list[tuple[list[str], Scheme]]                  # (targets, scheme); "Linear" targets every linear
    ignore: list[str] = field(default_factory=list)         # module names, or "re:<regex>" patterns
    ignore_substrings: bool = False   # modules_to_not_convert (awq, gptq, fp8): an entry inside the name skips it

    def scheme_for(self, name: str) -> Scheme | None:
        """The scheme of the linear layer `name` (its checkpoint name), or None if it stays unquantized."""
        if any(self._ignores(pattern, name) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets):
                return scheme
        return None

    def _ignores(self, pattern: str, name: str) -> bool:
        # vLLM and transformers read modules_to_not_convert as substrings ("visual" skips the vision tower).
        return pattern in name if self.ignore_substrings and not pattern.startswith("re:") else _matches(pattern, name)

    def scheme_for_shards(self, names: list[str]) -> Scheme | None:
        """One scheme for a fused layer whose shards (q/k/v, gate/up) are separate checkpoint layers."""
        schemes = {self.scheme_for(n) for n in names}
        if len(schemes) > 1:
            raise ModelLoadError(f"the {self.method} checkpoint quantizes {', '.join(names)} differently "
                                 f"({', '.join(sorted(str(s) for s in schemes))}); they run as one fused layer",
                                 code="unsupported_quantization")
        return schemes.pop()

    def describe(self) -> str:
        """For the start-up log: e.g. `awq, 4-bit, group 128`."""
        kinds = list(dict.fromkeys(s.describe() for _, s in self.groups))
        return ", ".join([self.method, *kinds])


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' convention: `re:` patterns match from the start of the name; a plain entry names the
    module itself or one of its parents (and, as vLLM reads it, a trailing part of the name: `lm_head`)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


def unsupported(what: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported quantized checkpoint: {what}", code="unsupported_quantization")


def canonical_method(name: str) -> str:
    method = ALIASES.get(name.lower(), name.lower())
    if method not in METHODS:
        raise unsupported(f"quantization method {name!r} (supported: {', '.join(METHODS)})")
    return method
