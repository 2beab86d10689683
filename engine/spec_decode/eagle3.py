"""The EAGLE-3 draft model: one Llama-style decoder layer that reads the target's hidden states.

Layout of the public EAGLE-3 checkpoints (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the Qwen3 ones trained the same
way): `fc` folds the target's three captured hidden states [T, 3*H_target] into one [T, H]; the layer's q/k/v take
2H inputs, the normed token embedding beside the normed hidden state; `lm_head` scores a smaller draft vocabulary
whose ids map to the target's through `d2t` (target_id = draft_id + d2t[draft_id]). The token embedding is the
target's unless the checkpoint carries its own.

The forward follows vLLM's llama_eagle3: the residual stream starts at the fed hidden state (fc's output for a
token the target computed, the draft's own pre-norm output for a drafted one) and the layer returns that stream
after the block (fed back to the next draft step) with its final-normed form (scored by lm_head). Attention reads
a per-request KV cache the caller owns (DraftKV), so the layer's math lives here and its state in the proposer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.config import ModelConfig, _rope_params, read_model_json
from engine.errors import ModelLoadError
from engine.model.layers import RotaryEmbedding
from engine.model.weight_files import safetensors_weights

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    vocab_size: int                   # the target's vocabulary (draft ids map into it)
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None   # target layers whose input stream is captured; None: vLLM's default
    norm_before_residual: bool = False      # the residual starts at hidden_norm(h) instead of h

    @classmethod
    def from_dict(cls, cfg: dict) -> "Eagle3Config":
        archs = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ModelLoadError(f"not an EAGLE-3 draft: architectures {archs!r}, expected one of "
                                 f"{', '.join(ARCHITECTURES)}", code="unsupported_architecture")
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
                   if k not in cfg]
        if missing:
            raise ModelLoadError(f"EAGLE-3 config.json lacks {', '.join(missing)}", code="bad_config")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        theta, scaling = _rope_params(cfg, cfg.get("model_type", "llama"))
        eagle = cfg.get("eagle_config") or {}
        layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise ModelLoadError(f"EAGLE-3 draft: unsupported rope_type {scaling['rope_type']!r} (supported: "
                                 f"default, llama3)", code="bad_config")
        return cls(
            hidden_size=hidden, target_hidden_size=cfg.get("target_hidden_size") or hidden,
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            aux_layer_ids=tuple(int(i) for i in layer_ids) if layer_ids else None,
            norm_before_residual=bool(cfg.get("norm_before_residual", False)))

    def rope_config(self) -> ModelConfig:
        """The fields RotaryEmbedding reads, as a (one-layer) ModelConfig."""
        return ModelConfig(architecture=ARCHITECTURES[0], model_type="llama", vocab_size=self.vocab_size,
                           hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=dict(self.rope_scaling))


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the draft's config names none: an early, a middle and a late layer."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class DraftKV:
    """One request's draft KV cache: rows in position order (positions increase along the cache), grown by
    doubling. The proposer owns one per request; the model appends to it."""

    MIN_ROWS = 16   # the first allocation

    def __init__(self, num_kv_heads: int, head_dim: int, device, dtype):
        self.k = torch.empty(0, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.positions: list[int] = []

    def __len__(self) -> int:
        return len(self.positions)

    def truncate(self, position: int) -> None:
        """Drop the rows at `position` and after (drafts of the last round, tokens the target rejected)."""
        keep = len(self.positions)
        while keep and self.positions[keep - 1] >= position:
            keep -= 1
        del self.positions[keep:]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [n, Hk, D] after the kept rows; returns every row's (K, V) up to them."""
        start, end = len(self.positions), len(self.positions) + k.shape[0]
        if end > self.k.shape[0]:
            cap = max(end, 2 * self.k.shape[0], self.MIN_ROWS)
            grown_k = self.k.new_empty(cap, *self.k.shape[1:])
            grown_v = self.v.new_empty(cap, *self.v.shape[1:])
            grown_k[:start], grown_v[:start] = self.k[:start], self.v[:start]
            self.k, self.v = grown_k, grown_v
        self.k[start:end], self.v[start:end] = k, v
        self.positions.extend(positions)
        return self.k[:end], self.v[:end]


@dataclass
class DraftSegment:
    """Rows [start, end) of a draft batch belong to one request and extend its cache `kv`."""
    kv: DraftKV
    start: int
    end: int


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3Config, max_positions: int, own_embedding: bool, qk_norm: bool):
        super().__init__()
        c = self.config = config
        h, d = c.hidden_size, c.head_dim
        self.q_size, self.kv_size = c.num_attention_heads * d, c.num_key_value_heads * d
        self.embed_tokens = nn.Embedding(c.vocab_size, h) if own_embedding else None
        self.fc = nn.Linear(3 * c.target_hidden_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(2 * h, self.q_size + 2 * self.kv_size, bias=False)
        self.q_norm = nn.Parameter(torch.ones(d)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if qk_norm else None
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(c.rope_config(), max_positions)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's captured states [T, 3*H_target] -> the draft's hidden [T, H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int],
                segments: list[DraftSegment]) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden: [T, H]; positions: T ints (the caches keep them); each segment's rows extend its
        request's cache.
        Returns (the pre-norm stream to feed back [T, H], the final-normed hidden for lm_head [T, H])."""
        eps = self.config.rms_norm_eps
        normed_hidden = ops.rms_norm(hidden, self.hidden_norm, eps)
        residual = normed_hidden if self.config.norm_before_residual else hidden
        x = torch.cat([ops.rms_norm(embeds, self.input_layernorm, eps), normed_hidden], dim=-1)
        x = self.o_proj(self._attention(x, positions, segments))
        x, residual = ops.rms_norm(x, self.post_attention_layernorm, eps, residual)
        x = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        prenorm = x + residual
        return prenorm, ops.rms_norm(prenorm, self.norm, eps)

    def _attention(self, x: torch.Tensor, positions: list[int], segments: list[DraftSegment]) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, c.num_attention_heads, c.head_dim)
        k = k.view(t, c.num_key_value_heads, c.head_dim)
        v = v.view(t, c.num_key_value_heads, c.head_dim)
        cos, sin = self.rotary(torch.tensor(positions, dtype=torch.int64, device=x.device))
        if self.q_norm is not None:
            q, k = ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, c.rms_norm_eps, cos, sin)
        else:
            q, k = ops.apply_rotary(q, k, cos, sin)
        out = torch.empty_like(q)
        for seg in segments:
            rows = slice(seg.start, seg.end)
            cached = len(seg.kv)
            keys, values = seg.kv.append(k[rows], v[rows], positions[rows])
            out[rows] = _causal_attention(q[rows], keys, values, cached)
        return out.view(t, self.q_size)

    def draft_token_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [T] in the target's vocabulary."""
        draft = self.lm_head(normed).argmax(dim=-1)
        return draft + self.d2t[draft]


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int) -> torch.Tensor:
    """q [n, Hq, D] for the last n of `keys`/`values` [cached + n, Hk, D]: row j sees keys 0..cached+j."""
    n, groups = q.shape[0], q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    rows = torch.arange(n, device=q.device)[:, None]
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= cached + rows
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=visible)
    return out.transpose(0, 1)


# ---- loading ---------------------------------------------------------------------------------------------------
_REQUIRED = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
             "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t")


def read_eagle3_weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors on the CPU, names without a leading `model.`."""
    if any(path.glob("*.safetensors")):
        raw = {name: t.read() for name, t in safetensors_weights(path, torch.device("cpu"))}
    elif (path / "pytorch_model.bin").is_file():
        raw = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"no EAGLE-3 weights in {path} (expected *.safetensors or pytorch_model.bin)",
                             code="missing_weights")
    return {name.removeprefix("model."): t for name, t in raw.items()}


def load_eagle3(path: str | Path, max_positions: int, device: torch.device, dtype: torch.dtype) -> Eagle3DraftModel:
    """The draft model of the EAGLE-3 checkpoint at `path`, on `device` in `dtype`; a ModelLoadError naming the
    missing file or tensor for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"EAGLE-3 draft model directory {path} does not exist", code="model_not_found")
    config = Eagle3Config.from_dict(read_model_json(path, "config.json", "the EAGLE-3 draft model's config"))
    w = read_eagle3_weights(path)
    missing = [name for name in _REQUIRED if name not in w]
    if missing:
        raise ModelLoadError(f"EAGLE-3 checkpoint {path} lacks {', '.join(missing)}", code="missing_weights")
    qk_norm = "midlayer.self_attn.q_norm.weight" in w
    model = Eagle3DraftModel(config, max_positions, "embed_tokens.weight" in w, qk_norm)
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    fused = {
        "fc.weight": w["fc.weight"],
        "input_layernorm": w["midlayer.input_layernorm.weight"],
        "hidden_norm": w["midlayer.hidden_norm.weight"],
        "qkv_proj.weight": torch.cat([w[f"{attn}{p}_proj.weight"] for p in "qkv"]),
        "o_proj.weight": w[f"{attn}o_proj.weight"],
        "post_attention_layernorm": w["midlayer.post_attention_layernorm.weight"],
        "gate_up_proj.weight": torch.cat([w[f"{mlp}gate_proj.weight"], w[f"{mlp}up_proj.weight"]]),
        "down_proj.weight": w[f"{mlp}down_proj.weight"],
        "norm": w["norm.weight"],
        "lm_head.weight": w["lm_head.weight"],
        "d2t": w["d2t"].to(torch.int64),
    }
    if qk_norm:
        fused["q_norm"], fused["k_norm"] = w[f"{attn}q_norm.weight"], w[f"{attn}k_norm.weight"]
    if model.embed_tokens is not None:
        fused["embed_tokens.weight"] = w["embed_tokens.weight"]
    state = model.state_dict()
    for name, tensor in fused.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ModelLoadError(f"EAGLE-3 tensor for {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(state[name].shape)} (from {path}/config.json)", code="shape_mismatch")
    model.load_state_dict(fused)
    for p in model.parameters():   # parameters only: the rotary tables stay fp32, d2t int64
        p.data = p.data.to(dtype)
    return model.to(device).eval().requires_grad_(False)
