"""Choosing the next token on the device: penalties, temperature, top-k, top-p, min-p, seeded or not.

Random rows draw through the exponential race (argmax of p / Exp(1)), which samples exactly from p without a
host sync; a request with a seed draws its noise from its own generator, so its output does not depend on
what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logits_processors import LogitsMasks, banned_by_bad_words
from engine.transfer import to_device


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None               # [B] fp32, 1.0 on greedy rows (None when all greedy)
    greedy: torch.Tensor | None                    # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None                     # [B] int64, vocab size where off
    top_p: torch.Tensor | None                     # [B] fp32, 1.0 where off
    min_p: torch.Tensor | None                     # [B] fp32, 0.0 where off
    presence: torch.Tensor | None                  # [B] fp32 penalties, None when every row has none
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_ids: list[list[int]]                    # per row, for the penalties
    prompt_ids: list[list[int]]
    banned: list[tuple[int, list[int]]]            # (row, token ids) never sampled this step: stop ids before
                                                   # min_tokens, bad words
    generators: dict[int, torch.Generator]         # row -> the request's own generator
    max_logprobs: int | None                       # top-k logprobs to return; None: none asked
    masks: LogitsMasks | None = None               # grammar, allowed_token_ids, logit_bias, bad_words

    @classmethod
    def from_requests(cls, reqs: list, vocab_size: int, device: torch.device,
                      num_outputs: list[int]) -> "SamplingMetadata":
        """reqs: the runner's records of the sampled requests (CachedRequestState); num_outputs[i]: the outputs
        reqs[i] had before the token sampled now, still pending ones included."""
        ps = [r.sampling_params for r in reqs]

        def column(values, dtype, neutral):
            if all(v == neutral for v in values):
                return None
            return to_device(values, dtype, device)

        greedy = [p.greedy for p in ps]
        banned = [(i, sorted(r.eos_token_ids | set(r.sampling_params.stop_token_ids)))
                  for i, (r, n) in enumerate(zip(reqs, num_outputs)) if n < r.sampling_params.min_tokens]
        banned += [(i, ids) for i, r in enumerate(reqs) if r.bad_words_token_ids
                   for ids in [banned_by_bad_words(r)] if ids]
        lp = [p.logprobs for p in ps if p.logprobs is not None]
        masks = LogitsMasks.from_requests(reqs, vocab_size, device)
        if all(greedy) and not banned and not lp and masks is None and not any(p.has_penalties for p in ps):
            return cls.greedy_only()   # the common decode case: no per-step host-to-device copies
        return cls(
            temperature=to_device([1.0 if g else p.temperature for g, p in zip(greedy, ps)], torch.float32, device),
            greedy=to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            top_k=column([p.top_k if p.top_k > 0 else vocab_size for p in ps], torch.int64, vocab_size),
            top_p=column([p.top_p for p in ps], torch.float32, 1.0),
            min_p=column([p.min_p for p in ps], torch.float32, 0.0),
            presence=column([p.presence_penalty for p in ps], torch.float32, 0.0),
            frequency=column([p.frequency_penalty for p in ps], torch.float32, 0.0),
            repetition=column([p.repetition_penalty for p in ps], torch.float32, 1.0),
            output_ids=[r.output_token_ids for r in reqs],
            prompt_ids=[r.prompt_token_ids for r in reqs],
            banned=banned,
            generators={i: r.generator for i, r in enumerate(reqs) if r.generator is not None},
            max_logprobs=max(lp) if lp else None,
            masks=masks,
        )

    @classmethod
    def greedy_only(cls) -> "SamplingMetadata":
        return cls(temperature=None, greedy=None, all_greedy=True, top_k=None, top_p=None, min_p=None,
                   presence=None, frequency=None, repetition=None, output_ids=[], prompt_ids=[], banned=[],
                   generators={}, max_logprobs=None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                        # [B] int64
    logprobs: list[dict[int, float]] | None        # per row: chosen + top-k token logprobs


def _token_counts(ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
    for row, row_ids in enumerate(ids):
        if row_ids:
            t = torch.tensor(row_ids, dtype=torch.int64, device=device)
            counts[row].scatter_add_(0, t, torch.ones_like(t, dtype=torch.float32))
    return counts


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[-1]
    if md.presence is not None or md.frequency is not None:
        out_counts = _token_counts(md.output_ids, vocab, logits.device)
        if md.frequency is not None:
            logits = logits - md.frequency[:, None] * out_counts
        if md.presence is not None:
            logits = logits - md.presence[:, None] * (out_counts > 0).float()
    if md.repetition is not None:
        # As transformers and vLLM: over prompt and output tokens, divide positive logits, multiply negative.
        seen = _token_counts([p + o for p, o in zip(md.prompt_ids, md.output_ids)], vocab, logits.device) > 0
        rep = md.repetition[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(-1, (logits.shape[-1] - top_k).clamp(min=0)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False          # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """logits: [B, V] fp32 for the rows that produce a token this step."""
    logits = apply_logits_changes(logits, md)
    logprobs = logprobs_fn(logits, md.max_logprobs)
    greedy_ids = logits.argmax(dim=-1)
    if md.all_greedy:
        return SamplerOutput(greedy_ids, logprobs(greedy_ids) if logprobs else None)
    random_ids = draw(sampling_probs(logits, md), md)
    ids = torch.where(md.greedy, greedy_ids, random_ids)
    return SamplerOutput(ids, logprobs(ids) if logprobs else None)


def apply_logits_changes(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The request's changes to the model's logits (masks, banned ids, penalties): what greedy takes the argmax
    of and logprobs report."""
    if md.masks is not None:
        logits = md.masks.apply(logits)
    for row, ids in md.banned:
        logits[row, ids] = float("-inf")
    return apply_penalties(logits, md)


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row samples from: temperature, then top-k, top-p and min-p."""
    x = logits / md.temperature[:, None]
    if md.top_k is not None or md.top_p is not None:
        x = _top_k_top_p(x, md.top_k, md.top_p)
    probs = x.softmax(dim=-1)
    if md.min_p is not None:
        probs = probs.masked_fill(probs < md.min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def draw(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One id per row, drawn in proportion to `probs` (which need not be normalized)."""
    noise = torch.empty_like(probs).exponential_()
    for row, gen in md.generators.items():
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def logprobs_fn(logits: torch.Tensor, k: int | None):
    if k is None:
        return None
    lp = logits.log_softmax(dim=-1)

    def gather(ids: torch.Tensor) -> list[dict[int, float]]:
        chosen = lp.gather(-1, ids[:, None]).squeeze(-1).tolist()
        rows = [{int(i): c} for i, c in zip(ids.tolist(), chosen)]
        if k > 0:
            top_v, top_i = lp.topk(k, dim=-1)
            for row, (vs, is_) in enumerate(zip(top_v.tolist(), top_i.tolist())):
                for v, i in zip(vs, is_):
                    rows[row].setdefault(i, v)
        return rows
    return gather
