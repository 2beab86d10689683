"""Gathering a quantized checkpoint's tensors layer by layer: the tensors of one layer (e.g. AWQ's qweight,
qzeros and scales) may sit in different shard files, so each layer's set is kept until complete and then
converted to the in-memory layout at once (the packed checkpoint tensors are dropped right after)."""
from __future__ import annotations

from types import ModuleType

import torch

from engine.errors import ModelLoadError
from engine.model.quantization import awq, compressed_tensors, fp8, gptq
from engine.model.quantization.config import QuantizationConfig
from engine.model.quantization.weights import Fp8Weights, WNA16Weights

FORMATS: dict[str, ModuleType] = {"fp8": fp8, "awq": awq, "gptq": gptq, "compressed-tensors": compressed_tensors}


class QuantizedTensorCollector:
    def __init__(self, quant: QuantizationConfig):
        self.quant = quant
        self.format = FORMATS[quant.method]
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def accepts(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `name` is part of a quantized layer (an fp8 `weight` is told from a float one by its dtype)."""
        leaf = name.rpartition(".")[2]
        if leaf not in self.format.LEAVES:
            return False
        return leaf != "weight" or tensor.dtype == torch.float8_e4m3fn

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, WNA16Weights | Fp8Weights] | None:
        """Keep `tensor`; once its layer's set is complete, return (layer name, its converted weights)."""
        module, _, leaf = name.rpartition(".")
        scheme = self.quant.scheme_for(module)
        if scheme is None:
            raise ModelLoadError(f"the checkpoint stores {module} quantized ({leaf}) but its quantization_config "
                                 f"leaves that layer unquantized", code="unsupported_quantization")
        required = self.format.required(scheme)
        if leaf not in required:
            return None   # e.g. a g_idx of plain contiguous groups beside compressed-tensors' actorder "weight"
        parts = self.pending.setdefault(module, {})
        parts[leaf] = tensor
        if not required <= parts.keys():
            return None
        del self.pending[module]
        return module, self.format.convert(parts, scheme, module)

    def check_complete(self) -> None:
        if self.pending:
            module, parts = next(iter(self.pending.items()))
            missing = self.format.required(self.quant.scheme_for(module)) - parts.keys()
            raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(f'{module}.{m}' for m in sorted(missing))}"
                                 + (f" (and {len(self.pending) - 1} more incomplete layers)"
                                    if len(self.pending) > 1 else ""), code="missing_weights")
