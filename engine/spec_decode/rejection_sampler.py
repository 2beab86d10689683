"""Verifying drafts in one target step (speculative decoding): each request that drafted k tokens has k + 1
rows of logits, the distributions after its newest token and after each prefix of the draft. Row j is processed
exactly as a one-token step would process it had the first j draft tokens been sampled (penalties, min_tokens,
bad words and the grammar all see them), so:

- greedy rows accept draft token j while it is row j's argmax: the output is token for token what one-token
  steps give;
- random rows accept draft token j with probability p_j(d_j) and, at the first rejection, draw from p_j with
  d_j removed (the residual max(p - q, 0) of a one-token draft q): the standard rejection sampling, whose
  output follows the target distribution exactly (drafts are one-hot: n-gram lookups and greedy draft heads).

After the accepted drafts each request gets one more token from the row where verification stopped (the bonus
token when all k were accepted), so a verify step yields 1 .. k + 1 tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.sampler import SamplingMetadata, apply_logits_changes, draw, logprobs_fn, sampling_probs
from engine.structured_output import apply_token_bitmask, bitmask_width
from engine.transfer import to_device


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]                   # per sampled request: its accepted drafts, then one more token
    logprobs: list[list[dict[int, float]]] | None  # per request, one entry per token (when asked)


def verify(logits: torch.Tensor, states: list, scheduled: list, device: torch.device) -> VerifyOutput:
    """logits: [R, V], each sampled request's k + 1 rows in order (k = len(its spec_token_ids)); states: the
    runner's records of the sampled requests (CachedRequestState), scheduled: their ScheduledRequests."""
    rows, num_outputs, starts = [], [], []
    for state, s in zip(states, scheduled):
        starts.append(len(rows))
        draft = s.spec_token_ids
        reads_outputs = state.sampling_params.has_penalties or bool(state.bad_words_token_ids)
        for j in range(len(draft) + 1):
            outputs = state.output_token_ids + draft[:j] if reads_outputs and j else state.output_token_ids
            rows.append(dataclasses.replace(state, output_token_ids=outputs, grammar=None))
            num_outputs.append(s.num_output_tokens + j)
    vocab = logits.shape[-1]
    _apply_grammars(logits, states, scheduled, starts, vocab, device)
    md = SamplingMetadata.from_requests(rows, vocab, device, num_outputs)
    logits = apply_logits_changes(logits, md)
    draft_ids = [t for s in scheduled for t in (*s.spec_token_ids, -1)]     # -1: a request's last row
    drafts = to_device(draft_ids, torch.int64, device)
    has_draft = drafts >= 0
    greedy_ids = logits.argmax(dim=-1)
    if md.all_greedy:
        chosen, accept = greedy_ids, drafts == greedy_ids
    else:
        probs = sampling_probs(logits, md)
        safe = drafts.clamp(min=0)[:, None]
        p_draft = probs.gather(-1, safe).squeeze(-1)
        accept_random = _uniform(p_draft, md) < p_draft
        residual = probs.scatter(-1, safe, torch.where(has_draft[:, None], 0.0, probs.gather(-1, safe)))
        chosen = torch.where(md.greedy, greedy_ids, draw(residual, md))
        accept = torch.where(md.greedy, drafts == greedy_ids, accept_random)
    accept &= has_draft
    accepted, chosen_host = accept.tolist(), chosen.tolist()
    token_ids, kept_rows = [], []
    for start, s in zip(starts, scheduled):
        draft = s.spec_token_ids
        a = 0
        while a < len(draft) and accepted[start + a]:
            a += 1
        token_ids.append(list(draft[:a]) + [chosen_host[start + a]])
        kept_rows.append((start, a))
    return VerifyOutput(token_ids, _logprobs(logits, md, token_ids, kept_rows, device))


def _apply_grammars(logits: torch.Tensor, states, scheduled, starts, vocab: int, device) -> None:
    """Each constrained request's rows get its grammar's mask after each prefix of its draft."""
    constrained = [(state, s, start) for state, s, start in zip(states, scheduled, starts)
                   if state.grammar is not None]
    if not constrained:
        return
    host = torch.full((logits.shape[0], bitmask_width(vocab)), -1, dtype=torch.int32)
    rows = []
    for state, s, start in constrained:
        state.grammar.fill_bitmasks_along(host, start, s.spec_token_ids)
        rows.extend(range(start, start + len(s.spec_token_ids) + 1))
    apply_token_bitmask(logits, to_device(host[rows], torch.int32, device), to_device(rows, torch.int64, device))


def _uniform(like: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One uniform draw per row in [0, 1), a seeded request's from its own generator."""
    u = torch.rand_like(like)
    for row, gen in md.generators.items():
        u[row] = torch.rand((), generator=gen, device=like.device)
    return u


def _logprobs(logits, md: SamplingMetadata, token_ids, kept_rows, device) -> list[list[dict]] | None:
    if md.max_logprobs is None:
        return None
    rows, ids = [], []
    for (start, a), tokens in zip(kept_rows, token_ids):
        rows.extend(range(start, start + a + 1))
        ids.extend(tokens)
    entries = logprobs_fn(logits[to_device(rows, torch.int64, device)], md.max_logprobs)(
        to_device(ids, torch.int64, device))
    out, at = [], 0
    for tokens in token_ids:
        out.append(entries[at:at + len(tokens)])
        at += len(tokens)
    return out
