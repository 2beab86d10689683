"""EAGLE-3 proposer: after each target step, runs the draft model over the tokens the target kept and drafts k
tokens for the requests that reached their newest token.

State: one DraftKV per request (the draft layer's K/V, in position order). Each propose() first cuts a request's
cache back to where its new feed starts (this drops last round's draft rows and anything the target rejected),
then extends it with the fed positions, then with the k-1 autoregressive draft steps. The drafts are greedy: the
rejection sampler treats them as one-hot proposals, so the target's output distribution stays exact whatever
the drafts are.

The proposer runs on the rank that samples (rank 0). Its token embedding is the checkpoint's own, or else the
target's (`target_model.decoder.embed_tokens`, wherever --cpu-embeddings keeps its table).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.spec_decode.eagle3 import DraftKV, DraftSegment, default_aux_layer_ids, load_eagle3


@dataclass
class DraftFeed:
    request_id: str
    positions: list[int]         # positions of the tokens the target just computed and kept (accepted), in order
    hidden_rows: torch.Tensor    # int64 indices into this step's aux tensor, one per position
    next_token_ids: list[int]    # for each position t, the token at t+1 (the last is the token sampled/accepted last)
    propose: bool                # True: draft k tokens after the last position now (the chunk reached the newest token)


class Eagle3Proposer:
    kv_min_rows = DraftKV.MIN_ROWS   # a request's draft KV is never smaller

    def __init__(self, draft_dir: str | Path, target_model, device, dtype, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        decoder = target_model.decoder
        # Drafts run up to k - 1 positions past the target's last one.
        max_positions = decoder.rotary.cos_cache.shape[0] + num_speculative_tokens
        self.model = load_eagle3(draft_dir, max_positions, torch.device(device), dtype)
        cfg, target_cfg = self.model.config, target_model.config
        if cfg.target_hidden_size != target_cfg.hidden_size:
            raise ModelLoadError(f"EAGLE-3 draft {draft_dir} expects a target of hidden size "
                                 f"{cfg.target_hidden_size}, the target has {target_cfg.hidden_size}",
                                 code="draft_mismatch")
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ModelLoadError(f"EAGLE-3 draft {draft_dir} maps into a vocabulary of {cfg.vocab_size} tokens, "
                                 f"the target has {target_cfg.vocab_size}", code="draft_mismatch")
        if self.model.embed_tokens is None and decoder.embed_tokens.tp_size > 1:
            raise ModelLoadError(f"EAGLE-3 draft {draft_dir} shares the target's token embedding, which tensor "
                                 f"parallelism splits over the ranks; run it with tensor_parallel_size 1",
                                 code="draft_mismatch")
        self.embed = self.model.embed_tokens if self.model.embed_tokens is not None else decoder.embed_tokens
        n_layers = target_cfg.num_hidden_layers
        self.aux_layer_ids: tuple[int, ...] = cfg.aux_layer_ids or default_aux_layer_ids(n_layers)
        bad = [i for i in self.aux_layer_ids if not 0 <= i < n_layers]
        if len(set(self.aux_layer_ids)) != 3 or bad:
            raise ModelLoadError(f"EAGLE-3 draft {draft_dir} reads target layers {list(self.aux_layer_ids)}; it "
                                 f"needs 3 distinct layers of the target's {n_layers}", code="draft_mismatch")
        self.device, self.dtype = torch.device(device), dtype
        self.k = num_speculative_tokens
        self.kv: dict[str, DraftKV] = {}

    def kv_bytes_per_token(self) -> int:
        """One position's K and V in the draft layer."""
        c = self.model.config
        return 2 * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted for recompute: its draft KV goes."""
        self.kv.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, feeds: list[DraftFeed], aux_hidden: torch.Tensor) -> dict[str, list[int]]:
        """`aux_hidden`: this step's captured target states [T, 3 * H_target] (the decoder's aux_hidden_states).
        Returns k draft token ids (target vocabulary) for each feed with propose=True."""
        for f in feeds:
            if not len(f.positions) == len(f.hidden_rows) == len(f.next_token_ids):
                raise ValueError(f"feed {f.request_id}: {len(f.positions)} positions, {len(f.hidden_rows)} hidden "
                                 f"rows and {len(f.next_token_ids)} next tokens; one of each per position")
        feeds = [f for f in feeds if f.positions]
        if not feeds:
            return {}
        segments, start = [], 0
        for f in feeds:
            kv = self.kv.get(f.request_id)
            if kv is None:
                kv = self.kv[f.request_id] = DraftKV(self.model.config.num_key_value_heads,
                                                     self.model.config.head_dim, self.device, self.dtype)
            kv.truncate(f.positions[0])
            segments.append(DraftSegment(kv, start, start + len(f.positions)))
            start += len(f.positions)
        rows = torch.cat([f.hidden_rows for f in feeds]).to(aux_hidden.device)
        hidden = self.model.combine_hidden_states(aux_hidden.index_select(0, rows).to(self.device))
        token_ids = torch.tensor([t for f in feeds for t in f.next_token_ids], dtype=torch.int64)
        positions = [p for f in feeds for p in f.positions]
        prenorm, normed = self._step(token_ids, hidden, positions, segments)

        asked = [i for i, f in enumerate(feeds) if f.propose]
        if not asked:
            return {}
        last = torch.tensor([segments[i].end - 1 for i in asked], device=self.device)
        hidden, normed = prenorm[last], normed[last]
        positions = [feeds[i].positions[-1] for i in asked]
        segments = [DraftSegment(segments[i].kv, j, j + 1) for j, i in enumerate(asked)]
        drafts = [self.model.draft_token_ids(normed)]
        for _ in range(self.k - 1):
            positions = [p + 1 for p in positions]
            hidden, normed = self._step(drafts[-1], hidden, positions, segments)
            drafts.append(self.model.draft_token_ids(normed))
        per_request = torch.stack(drafts, dim=1).tolist()
        return {feeds[i].request_id: ids for i, ids in zip(asked, per_request)}

    def _step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: list[int],
              segments: list[DraftSegment]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over rows (token_ids[j] embedded beside hidden[j], at positions[j])."""
        embeds = self.embed(token_ids.to(self.device)).to(self.dtype)
        return self.model(embeds, hidden, positions, segments)
