"""Quantized checkpoints: `quantization_config` parsing (config, parse), the quantized linear layers (layers),
per-format converters from checkpoint tensors to one in-memory layout (fp8, awq, gptq, compressed_tensors) and the
loader's per-layer gathering (loading)."""
