"""Structured output: a request's constraint (JSON schema, regex, choice, grammar) as a per-token mask.

llguidance (a Rust grammar engine, one small wheel without dependencies) compiles the constraint against the
model's tokenizer; each request owns a matcher that consumes its sampled tokens and fills a bitmask of the
tokens allowed next (bit t of row r: token t may follow). The sampler applies the mask on the device
(apply_token_bitmask). Chosen over xgrammar by measurement (bench/grammar_mask.py, BENCHMARKS.md): a schema
compiles several times faster, the per-token mask costs a small fraction of a decode step, and xgrammar would
pull triton into CPU installs.

The runner alone feeds a matcher (it holds it in its CachedRequestState): before each step that samples the
request, every output token so far, the one of the step still in flight included, so the mask of the next
step is computed while the device runs its forward.
"""
from __future__ import annotations

import json
import threading

import torch

from engine.errors import InvalidInputError
from engine.logger import init_logger
from engine.sampling_params import JSON_WHITESPACE, StructuredOutputsParams

logger = init_logger(__name__)


def grammar_spec(so: StructuredOutputsParams, end_token: int | None = None) -> str:
    """The llguidance grammar for `so`; a schema, regex or grammar that does not compile is a 400 here.
    end_token: the id of `so.reasoning_end` where the vocabulary holds it as one added token."""
    spec = _constraint_spec(so)
    return spec if so.reasoning_end is None else spec_after_reasoning(spec, so.reasoning_end, end_token)


def spec_after_reasoning(spec: str, end: str, end_token: int | None = None) -> str:
    """`spec` preceded by free reasoning text, the `end` tag and a little whitespace (Qwen writes two newlines;
    unbounded, a random or weak model could pad forever). llguidance sees an
    added token (Qwen3's `</think>`) as a special token, outside any text: the grammar names it by id, after a
    free-text lexeme. A tag the vocabulary spells in pieces ends a lazy rule instead (stop=)."""
    body = json.loads(spec)["grammars"] if spec.lstrip().startswith("{") else [{"lark_grammar": spec}]
    if end_token is not None:
        outer = f"start: REASONING <[{end_token}]> /[ \\t\\n]{{0,4}}/ @answer\nREASONING: /(.|\\n)*/\n"
    else:
        outer = (f"start: reasoning /[ \\t\\n]{{0,4}}/ @answer\n"
                 f"reasoning[stop={json.dumps(end)}]: /(.|\\n)*/\n")
    return json.dumps({"grammars": [{"lark_grammar": outer}, {**body[0], "name": "answer"}, *body[1:]]})


def _constraint_spec(so: StructuredOutputsParams) -> str:
    import llguidance
    param = f"structured_outputs.{so.kind}"
    try:
        if so.json is not None or so.json_object:
            schema = {"type": "object"} if so.json_object else so.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            defaults = {"whitespace_flexible": False} if so.disable_any_whitespace else \
                {"whitespace_pattern": JSON_WHITESPACE}
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
        if so.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(so.regex)
        if so.choice is not None:
            return llguidance.grammar_from("choice", so.choice)
        return llguidance.grammar_from("grammar", so.grammar)
    except (ValueError, TypeError) as e:
        raise InvalidInputError(f"{param} is not valid: {e}", param=param) from None


class Grammar:
    """One request's matcher. `num_consumed` output tokens have been fed to it."""

    def __init__(self, matcher, eos_token_ids: list[int]):
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_consumed = 0

    def fork(self) -> "Grammar":
        return Grammar(self.matcher.deep_copy(), self.eos_token_ids)

    def consume(self, output_token_ids: list[int]) -> None:
        """Feed the output tokens this matcher has not seen yet (a no-op when it has seen them all)."""
        for token in output_token_ids[self.num_consumed:]:
            if not self.matcher.consume_token(token) and not self.matcher.is_stopped():
                logger.warning("structured output: token %d was refused by the grammar: %s", token,
                               self.matcher.get_error())
            self.num_consumed += 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the int32 host bitmask: the tokens allowed next. A matcher in error (it cannot
        happen while its mask is applied) allows only EOS, so the request ends instead of wandering."""
        if self.matcher.is_error():
            bitmask[row] = 0
            for t in self.eos_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def fill_bitmasks_along(self, bitmask: torch.Tensor, first_row: int, draft: list[int]) -> None:
        """Rows first_row .. first_row + len(draft) of `bitmask`: the tokens allowed after each prefix of the
        draft (speculative decoding's verify step), the matcher left as it was. Past a draft token the grammar
        refuses, the rows repeat the last mask: that token is rejected there, so they are never used."""
        valid = self.matcher.validate_tokens(draft) if draft else 0     # the draft's prefix the grammar takes
        for j in range(len(draft) + 1):
            row = first_row + j
            if j > valid:
                bitmask[row] = bitmask[row - 1]
                continue
            self.fill_bitmask(bitmask, row)
            if j < valid:
                self.matcher.consume_token(draft[j])
        if valid:
            self.matcher.rollback(valid)


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else 1 << i     # int32 two's complement


class StructuredOutputManager:
    """Owns the llguidance tokenizer (built on first use: about a second for a large vocabulary) and compiles
    requests' constraints into Grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for `so`; raises InvalidInputError (400) when the constraint does not compile."""
        import llguidance
        spec = grammar_spec(so, self._added_token(so.reasoning_end))
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), spec, log_level=0)
        if matcher.is_error():
            param = f"structured_outputs.{so.kind}"
            raise InvalidInputError(f"{param} is not valid: {matcher.get_error()}", param=param)
        return Grammar(matcher, self.eos_token_ids)

    def _added_token(self, text: str | None) -> int | None:
        """The id of `text` when the vocabulary holds it as one token that llguidance takes as special."""
        if text is None:
            return None
        token = self.tokenizer.convert_tokens_to_ids(text)
        if not isinstance(token, int) or token == self.tokenizer.unk_token_id or token >= self.vocab_size:
            return None
        return token if self.ll_tokenizer().is_special_token(token) else None


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows] keep only the tokens whose bit is set in `bitmask` ([len(rows), W] int32, on the device)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def catch_up_grammars(so, sampled, prev) -> None:
    """Feed each constrained request's matcher every token sampled before step `so`, including the one the step
    in flight (`prev`) sampled as its pending input: reading that step here overlaps the host's mask work with
    this step's forward, which is already queued on the device. `sampled`: the runner's records
    (CachedRequestState) of so.sampled, whose output_token_ids prev.result() extends."""
    for s, state in zip(so.sampled, sampled):
        if state.grammar is None:
            continue
        if s.pending_row is not None:
            prev.result()
        state.grammar.consume(state.output_token_ids)
