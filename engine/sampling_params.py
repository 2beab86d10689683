"""How to pick each next token and when to stop: vLLM's SamplingParams, with its names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidInputError

_GREEDY_EPS = 1e-5
# Optional whitespace between JSON tokens in a structured output: one space, or one line break and an indentation;
# what compact and pretty-printed JSON use. Unbounded whitespace would let a model (surely a random one) pad
# forever inside a valid prefix.
JSON_WHITESPACE = r"(\x20|\n[\x20\x09]{0,32})?"


@dataclass
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one constraint the output must match (engine/structured_output.py
    compiles it into a token mask)."""
    json: str | dict | None = None         # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None             # Lark or GBNF/EBNF
    json_object: bool | None = None        # any JSON object
    disable_any_whitespace: bool = False   # JSON without optional whitespace
    # A reasoning model's end-of-thinking tag (`</think>`): the constraint applies to the text after it, the
    # reasoning before it is free (the server sets it with --reasoning-parser).
    reasoning_end: str | None = None
    # Set when the server compiled it ahead (a worker thread, not the engine loop); each request forks it. A
    # cache of rank 0's engine core: it never travels with a step (__getstate__).
    compiled: object = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "compiled": None}

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(given) != 1:
            raise InvalidInputError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                                    f"json_object; got {given or 'none'}", param="structured_outputs")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise InvalidInputError("structured_outputs.choice must be a non-empty list of strings",
                                    param="structured_outputs.choice")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16        # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None        # number of top log-probabilities to return per token (0: only the chosen)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # top log-probabilities per prompt token (0: only the prompt's own)
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit
    allowed_token_ids: list[int] | None = None     # only these may be sampled
    bad_words: list[str] | None = None             # never generated (the engine tokenizes them)
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise InvalidInputError("stop must be a string or a list of strings", param="stop")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidInputError("stop_token_ids must be a list of integers", param="stop_token_ids")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads earlier token ids (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _validate(self) -> None:
        numbers = [("temperature", self.temperature), ("top_p", self.top_p), ("min_p", self.min_p),
                   ("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty),
                   ("repetition_penalty", self.repetition_penalty)]
        for param, value in numbers:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidInputError(f"{param} must be a number", param=param)
        ints = [("top_k", self.top_k), ("n", self.n), ("min_tokens", self.min_tokens)]
        ints += [(name, v) for name, v in (("max_tokens", self.max_tokens), ("logprobs", self.logprobs),
                                           ("prompt_logprobs", self.prompt_logprobs)) if v is not None]
        for param, value in ints:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInputError(f"{param} must be an integer", param=param)
        checks = [
            (self.n == 1, "n", "an engine request is one sequence (n=1); the server's n fans out into n requests"),
            (0.0 <= self.temperature <= 100.0, "temperature", "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "top_k must be -1, 0 (off) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "repetition_penalty must be in (0, 2]"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "max_tokens must be at least 1"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
             "min_tokens", "min_tokens must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "prompt_logprobs must be in [0, 20]"),
            (self.logit_bias is None or all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float))
                                            and -100 <= b <= 100 for t, b in self.logit_bias.items()),
             "logit_bias", "logit_bias maps token ids to numbers in [-100, 100]"),
            (self.allowed_token_ids is None or (self.allowed_token_ids and all(
                isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
             "allowed_token_ids must be a non-empty list of token ids"),
            (self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words), "bad_words",
             "bad_words must be non-empty strings"),
            (all(isinstance(s, str) and s for s in self.stop_strings), "stop", "stop must be non-empty strings"),
            (len(self.stop_strings) <= 16, "stop", "at most 16 stop strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63), "seed",
             "seed must be a 64-bit integer"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidInputError(message, param=param)
