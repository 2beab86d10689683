"""The EAGLE-3 drafter: the draft model read from the public checkpoint layout, the proposer's per-request draft KV
(incremental proposing equals recomputing from scratch, rejection cuts the cache back), and the target decoder's
capture of the hidden states the draft reads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from engine import SamplingParams
from engine.errors import ModelLoadError
from engine.spec_decode.eagle3 import load_eagle3
from engine.spec_decode.eagle3_proposer import DraftFeed, Eagle3Proposer
from engine_helpers import make_llm


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_dir):
    return make_llm(qwen3_dir)


@pytest.fixture(scope="module")
def target(qwen3_llm):
    return qwen3_llm.engine.model_executor.driver_worker.model


def proposer(draft_dir, target, k=3) -> Eagle3Proposer:
    return Eagle3Proposer(draft_dir, target, "cpu", torch.float32, k)


# ---- loading ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("own_embedding", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_loader_reads_the_public_layout(qwen3_dir, tmp_path, own_embedding, qk_norm):
    d = tiny_models.build_eagle3(qwen3_dir, tmp_path / "draft", own_embedding=own_embedding, qk_norm=qk_norm)
    w = load_file(d / "model.safetensors")
    model = load_eagle3(d, 256, torch.device("cpu"), torch.float32)

    assert (model.embed_tokens is not None) == own_embedding
    if own_embedding:
        assert torch.equal(model.embed_tokens.weight, w["embed_tokens.weight"])
    assert (model.q_norm is not None) == qk_norm
    attn = "midlayer.self_attn."
    assert torch.equal(model.qkv_proj.weight, torch.cat([w[f"{attn}{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(model.gate_up_proj.weight, torch.cat([w["midlayer.mlp.gate_proj.weight"],
                                                             w["midlayer.mlp.up_proj.weight"]]))
    assert torch.equal(model.hidden_norm, w["midlayer.hidden_norm.weight"])
    assert torch.equal(model.d2t, w["d2t"])
    assert model.lm_head.weight.shape[0] == model.config.draft_vocab_size < model.config.vocab_size


def test_bf16_load_keeps_rotary_in_fp32_and_d2t_int64(eagle3_dir):
    model = load_eagle3(eagle3_dir, 256, torch.device("cpu"), torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16
    assert model.rotary.cos_cache.dtype == torch.float32
    assert model.d2t.dtype == torch.int64


def _copy_without(src: Path, dst: Path, drop: str = "", reshape: str = "", config: dict | None = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    w = load_file(src / "model.safetensors")
    w.pop(drop, None)
    if reshape:
        w[reshape] = w[reshape][:-1].contiguous()
    save_file(w, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("case, message", [
    ("missing_dir", "does not exist"),
    ("no_config", "has no config.json"),
    ("wrong_arch", "not an EAGLE-3 draft"),
    ("no_weights", "no EAGLE-3 weights"),
    ("missing_tensor", "lacks midlayer.hidden_norm.weight"),
    ("missing_d2t", "lacks d2t"),
    ("wrong_shape", "lm_head.weight has shape"),
    ("bad_rope", "unsupported rope_type 'yarn'"),
])
def test_loader_refuses_a_wrong_directory_naming_what_is_missing(eagle3_dir, qwen3_dir, tmp_path, case, message):
    path = {
        "missing_dir": lambda: tmp_path / "nowhere",
        "no_config": lambda: tmp_path,
        "wrong_arch": lambda: qwen3_dir,
        "no_weights": lambda: _no_weights(eagle3_dir, tmp_path / "d"),
        "missing_tensor": lambda: _copy_without(eagle3_dir, tmp_path / "d", drop="midlayer.hidden_norm.weight"),
        "missing_d2t": lambda: _copy_without(eagle3_dir, tmp_path / "d", drop="d2t"),
        "wrong_shape": lambda: _copy_without(eagle3_dir, tmp_path / "d", reshape="lm_head.weight"),
        "bad_rope": lambda: _copy_without(eagle3_dir, tmp_path / "d",
                                          config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    }[case]()
    with pytest.raises(ModelLoadError, match=message):
        load_eagle3(path, 256, torch.device("cpu"), torch.float32)


def _no_weights(src: Path, dst: Path) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_proposer_refuses_a_draft_for_another_target(llama_dir, target, tmp_path):
    draft = tiny_models.build_eagle3(llama_dir, tmp_path / "llama-draft")   # hidden 48, the Qwen3 target has 64
    with pytest.raises(ModelLoadError, match="target of hidden size 48"):
        proposer(draft, target)


def test_aux_layers_come_from_the_config_or_vllm_default(qwen3_dir, target, tmp_path):
    named = tiny_models.build_eagle3(qwen3_dir, tmp_path / "named", aux_layer_ids=[2, 0, 1])
    assert proposer(named, target).aux_layer_ids == (2, 0, 1)
    default = _copy_without(named, tmp_path / "default", config={"eagle_config": {}})
    assert proposer(default, target).aux_layer_ids == (2, 1, 0)   # (2, L // 2, L - 3) for the 3 layers


# ---- the draft model -------------------------------------------------------------------------------------------
def test_d2t_maps_draft_ids_into_the_target_vocabulary(eagle3_dir):
    model = load_eagle3(eagle3_dir, 256, torch.device("cpu"), torch.float32)
    t2d = load_file(eagle3_dir / "model.safetensors")["t2d"]
    normed = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    draft_ids = model.lm_head(normed).argmax(-1)
    target_ids = model.draft_token_ids(normed)
    assert torch.equal(target_ids, draft_ids * 3), "the tiny draft vocabulary is every third target id"
    assert t2d[target_ids].all()
    assert (target_ids != draft_ids).any()


# ---- the proposer ----------------------------------------------------------------------------------------------
class History:
    """A request's token sequence and, per position, the target's captured row (random, fixed per position)."""

    def __init__(self, seed: int, length: int, vocab: int, aux_width: int):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (length + 1,), generator=gen).tolist()
        self.aux = torch.randn(length, aux_width, generator=gen)

    def feed(self, rid: str, start: int, end: int, propose: bool,
             row_offset: int = 0) -> tuple[DraftFeed, torch.Tensor]:
        """Positions [start, end) as one feed, with its aux rows (at row_offset in the step's aux tensor)."""
        return DraftFeed(rid, list(range(start, end)), torch.arange(row_offset, row_offset + end - start),
                         self.tokens[start + 1:end + 1], propose), self.aux[start:end]


def run_step(p: Eagle3Proposer, parts: list[tuple[DraftFeed, torch.Tensor]]) -> dict[str, list[int]]:
    return p.propose([f for f, _ in parts], torch.cat([a for _, a in parts]))


def fresh_drafts(draft_dir, target, history: History, end: int, k: int = 3) -> list[int]:
    """Drafts of a new proposer fed positions [0, end) at once."""
    return run_step(proposer(draft_dir, target, k), [history.feed("r", 0, end, True)])["r"]


@pytest.fixture(scope="module")
def history(target):
    return History(0, 40, target.config.vocab_size, 3 * target.config.hidden_size)


def test_drafts_are_k_target_ids_only_for_feeds_that_ask(eagle3_dir, target, history):
    p = proposer(eagle3_dir, target, k=4)
    assert run_step(p, [history.feed("r", 0, 6, False)]) == {}
    drafts = run_step(p, [history.feed("r", 6, 12, True)])["r"]
    assert len(drafts) == 4 and all(t % 3 == 0 for t in drafts)


def test_incremental_proposing_equals_recomputing_from_scratch(eagle3_dir, target, history):
    p = proposer(eagle3_dir, target)
    run_step(p, [history.feed("r", 0, 7, False)])                  # a prefill chunk
    assert run_step(p, [history.feed("r", 7, 15, True)])["r"] == fresh_drafts(eagle3_dir, target, history, 15)
    # Every draft accepted plus the bonus token: positions 15..18 come back.
    assert run_step(p, [history.feed("r", 15, 19, True)])["r"] == fresh_drafts(eagle3_dir, target, history, 19)
    for end in range(20, 24):                                      # plain decode steps, one token each
        assert run_step(p, [history.feed("r", end - 1, end, True)])["r"] == \
            fresh_drafts(eagle3_dir, target, history, end)


def test_a_rejection_cuts_the_draft_cache_back_to_the_kept_positions(eagle3_dir, target, history):
    p = proposer(eagle3_dir, target, k=3)
    run_step(p, [history.feed("r", 0, 12, True)])    # draft rows now sit at positions 12 and 13
    assert p.kv["r"].positions[-2:] == [12, 13]
    # The target rejected every draft: only the token it sampled at position 12 is kept.
    assert run_step(p, [history.feed("r", 12, 13, True)])["r"] == fresh_drafts(eagle3_dir, target, history, 13)
    assert p.kv["r"].positions == list(range(15)), "kept 0..12, then drafted at 13 and 14"
    # A partial accept of a later round: two of three kept.
    assert run_step(p, [history.feed("r", 13, 15, True)])["r"] == fresh_drafts(eagle3_dir, target, history, 15)


def test_requests_batched_in_one_step_draft_as_they_do_alone(eagle3_dir, target, history):
    other = History(1, 40, target.config.vocab_size, 3 * target.config.hidden_size)
    p = proposer(eagle3_dir, target)
    a, b = history.feed("a", 0, 9, True), other.feed("b", 0, 5, True, row_offset=9)
    both = run_step(p, [a, b])
    assert both == {"a": fresh_drafts(eagle3_dir, target, history, 9),
                    "b": fresh_drafts(eagle3_dir, target, other, 5)}
    a, b = history.feed("a", 9, 11, True), other.feed("b", 5, 6, False, row_offset=2)
    assert run_step(p, [a, b]) == {"a": fresh_drafts(eagle3_dir, target, history, 11)}


def test_forget_drops_the_request_state(eagle3_dir, target, history):
    p = proposer(eagle3_dir, target)
    run_step(p, [history.feed("r", 0, 9, True)])
    p.forget("r")
    assert "r" not in p.kv
    p.forget("r")                                     # forgetting twice (finished after preemption) is harmless
    # Preempted for recompute: the request comes back from position 0 and drafts as a new one.
    assert run_step(p, [history.feed("r", 0, 9, True)])["r"] == fresh_drafts(eagle3_dir, target, history, 9)


def test_a_gap_in_the_feed_still_drafts(eagle3_dir, target, history):
    """After a prefix-cache hit the draft never saw the skipped positions: it drafts from what it has."""
    p = proposer(eagle3_dir, target, k=2)
    drafts = run_step(p, [history.feed("r", 8, 12, True)])["r"]
    assert len(drafts) == 2
    assert p.kv["r"].positions == [8, 9, 10, 11, 12]


def test_drafts_run_past_the_targets_last_position(eagle3_dir, target):
    """The target's last position is max_positions - 1; the k - 1 draft steps after it still have rotary rows."""
    last = target.decoder.rotary.cos_cache.shape[0] - 1
    feed = DraftFeed("r", [last - 1, last], torch.arange(2), [5, 6], True)
    aux = torch.randn(2, 3 * target.config.hidden_size)
    assert len(proposer(eagle3_dir, target, k=4).propose([feed], aux)["r"]) == 4


def test_a_feed_needs_one_row_and_one_next_token_per_position(eagle3_dir, target):
    feed = DraftFeed("r", [0, 1, 2], torch.arange(3), [5, 6], True)
    with pytest.raises(ValueError, match="3 positions, 3 hidden rows and 2 next tokens"):
        proposer(eagle3_dir, target).propose([feed], torch.randn(3, 3 * target.config.hidden_size))


def test_own_embedding_draft_reads_its_table_not_the_targets(qwen3_dir, target, history, tmp_path):
    own = tiny_models.build_eagle3(qwen3_dir, tmp_path / "own", own_embedding=True)
    p = proposer(own, target)
    assert p.embed is p.model.embed_tokens
    assert run_step(p, [history.feed("r", 0, 9, True)])["r"] == fresh_drafts(own, target, history, 9)


def reference_drafts(draft_dir: Path, target_table: torch.Tensor, history: History, end: int, k: int) -> list[int]:
    """vLLM's EAGLE-3 math written out from the checkpoint's own tensors, recomputing full causal attention over
    every row for each draft step (no cache, no fused projections)."""
    w = load_file(draft_dir / "model.safetensors")
    embed_table = w.get("embed_tokens.weight", target_table)
    cfg = json.loads((draft_dir / "config.json").read_text())
    heads, kv_heads, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], 1e-6
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):   # x [T, heads, d]: rotate-half pairs (j, j + d/2)
        angle = pos[:, None].float() * inv_freq[None, :]
        cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def layer(tokens, hidden, pos):
        a = "midlayer.self_attn."
        x = torch.cat([rms(embed_table[tokens], w["midlayer.input_layernorm.weight"]),
                       rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
        t = x.shape[0]
        q = (x @ w[f"{a}q_proj.weight"].T).view(t, heads, d)
        kk = (x @ w[f"{a}k_proj.weight"].T).view(t, kv_heads, d)
        if f"{a}q_norm.weight" in w:   # Qwen3: RMSNorm per head before the rotary
            q, kk = rms(q, w[f"{a}q_norm.weight"]), rms(kk, w[f"{a}k_norm.weight"])
        q, kk = rope(q, pos), rope(kk, pos)
        v = (x @ w[f"{a}v_proj.weight"].T).view(t, kv_heads, d)
        out = torch.empty(t, heads, d)
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = (q[:, head] @ kk[:, kv].T) / d ** 0.5
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            out[:, head] = scores.softmax(-1) @ v[:, kv]
        stream = out.reshape(t, -1) @ w[f"{a}o_proj.weight"].T + hidden
        y = rms(stream, w["midlayer.post_attention_layernorm.weight"])
        m = "midlayer.mlp."
        prenorm = (torch.nn.functional.silu(y @ w[f"{m}gate_proj.weight"].T) * (y @ w[f"{m}up_proj.weight"].T)) \
            @ w[f"{m}down_proj.weight"].T + stream
        draft = (rms(prenorm, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
        return prenorm, draft + w["d2t"][draft]

    tokens = torch.tensor(history.tokens[1:end + 1])
    hidden = history.aux[:end] @ w["fc.weight"].T
    pos = torch.arange(end)
    drafts = []
    for _ in range(k):
        prenorm, target_ids = layer(tokens, hidden, pos)
        drafts.append(int(target_ids[-1]))
        tokens = torch.cat([tokens, target_ids[-1:]])
        hidden = torch.cat([hidden, prenorm[-1:]])
        pos = torch.cat([pos, pos[-1:] + 1])
    return drafts


@pytest.mark.parametrize("own_embedding, qk_norm", [(False, False), (True, True)])
def test_drafts_follow_the_eagle3_math_of_the_checkpoint(qwen3_dir, target, history, tmp_path, own_embedding,
                                                         qk_norm):
    draft = tiny_models.build_eagle3(qwen3_dir, tmp_path / "draft", own_embedding=own_embedding, qk_norm=qk_norm)
    target_table = target.decoder.embed_tokens.weight.float()
    for end in (1, 6, 17):
        assert fresh_drafts(draft, target, history, end, k=4) == \
            reference_drafts(draft, target_table, history, end, k=4)


# ---- capturing the target's hidden states ----------------------------------------------------------------------
def _generate(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("model_fixture, buffer_rows", [
    ("qwen3_dir", None), ("llama_dir", None), ("qwen3_vl_dir", None),
    ("qwen3_dir", 4),   # a static buffer (CUDA graphs' form): decode steps fit it, the prompts' prefills do not
])
def test_aux_capture_leaves_outputs_identical_and_records_the_residual_stream(request, model_fixture,
                                                                               buffer_rows):
    llm = make_llm(request.getfixturevalue(model_fixture))
    model = llm.engine.model_executor.driver_worker.model
    decoder = model.decoder
    prompts = ["The capital of France is", "Once upon a time there was a small cat"]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
    off = _generate(llm, prompts, params)
    assert decoder.aux_hidden_states is None, "capture off records nothing"

    layers = (0, 1, len(decoder.layers) - 1)
    streams, steps = {}, []

    def pre_hook(i):
        def hook(module, args):
            h, residual = args[0], args[1]
            streams[i] = h if residual is None else h + residual
        return hook

    def post_hook(module, args, out):
        got = decoder.aux_hidden_states   # copied now: a static buffer holds only the latest step's states
        steps.append((torch.cat([streams[i] for i in layers], dim=-1), got.clone(), got.data_ptr()))

    handles = [decoder.layers[i].register_forward_pre_hook(pre_hook(i)) for i in layers]
    handles.append(decoder.register_forward_hook(post_hook))
    decoder.aux_hidden_state_layers = layers
    width = 3 * model.config.hidden_size
    buffer = torch.full((buffer_rows, width), float("nan")) if buffer_rows else None
    decoder.aux_buffer = buffer
    try:
        on = _generate(llm, prompts, params)
    finally:
        for h in handles:
            h.remove()
        decoder.aux_hidden_state_layers, decoder.aux_buffer = (), None
    assert on == off, "capturing changes no token and no logprob"
    assert steps and all(got.shape == (ref.shape[0], width) for ref, got, _ in steps)
    assert all(torch.equal(got, ref) for ref, got, _ in steps)
    if buffer is not None:
        in_buffer = [ptr == buffer.data_ptr() for _, _, ptr in steps]
        assert any(in_buffer) and not all(in_buffer), "decode steps write into the buffer, longer prefills do not"


def test_the_kv_pool_leaves_room_for_the_drafts_own_kv(qwen3_dir, eagle3_dir):
    # Each running request's draft KV holds at most twice its context (grown by doubling, from DraftKV.MIN_ROWS
    # rows): the pool and those rows share the budget, so a full pool cannot run the drafter out of memory.
    common = dict(num_gpu_blocks_override=None, cpu_kv_cache_space=0.001, max_num_seqs=4)
    plain = make_llm(qwen3_dir, **common).engine.kv_cache_config
    spec_llm = make_llm(qwen3_dir, speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                       "model": str(eagle3_dir)}, **common)
    spec = spec_llm.engine.kv_cache_config
    drafter = spec_llm.engine.model_executor.driver_worker.model_runner.drafter
    cfg, row, budget = drafter.model.config, drafter.kv_bytes_per_token(), int(0.001 * 2**30)
    assert row == 2 * cfg.num_key_value_heads * cfg.head_dim * 4          # K and V, float32 on the CPU
    assert plain.num_gpu_blocks == budget // plain.bytes_per_block
    draft_rows = 2 * spec.num_gpu_blocks * 16 + drafter.kv_min_rows * 4   # block size 16, 4 running at most
    assert spec.num_gpu_blocks * spec.bytes_per_block + draft_rows * row <= budget
    assert (spec.num_gpu_blocks + 1) * spec.bytes_per_block + (draft_rows + 32) * row > budget   # and no less
