"""When a request speculates. A verify step of 1 + k tokens costs more than a one-token step: its linears read
more rows, a rejected draft is computed for nothing, and (on a GPU) the next step waits for its tokens instead of
being launched behind it. Drafting pays only while a request's tokens per verify step (its kept drafts and one
more) exceed that cost ratio. So the policy measures both as the engine runs: StepCosts times the steps of each
batch size with and without speculation, and each request keeps a running mean of its tokens per verify step. A
request whose drafts do not pay backs off for a while (longer each time in a row) and is measured afresh when it
tries again. Batches of disable_by_batch_size or more do not speculate at all."""
from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.config import SpeculativeConfig

MIN_BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 256
JUDGE_AFTER = 4                  # verify steps since a request (re)started before its drafts are judged
TOKENS_WEIGHT = 0.25             # of the newest verify step in a request's running mean of tokens per step
UNMEASURED_COST_RATIO = 1.1      # the bar while a batch size's step costs are not both measured yet
COST_WEIGHT = 0.2                # of the newest step time in StepCosts' running means
MIN_COST_SAMPLES = 3             # steps of a kind before its running mean counts
PLAIN_EVERY = 256                # speculative steps of one batch size before its plain step is timed again


@dataclass
class _Mean:
    """A running mean (exponentially weighted) and how many values went into it."""
    value: float = 0.0
    count: int = 0

    def add(self, x: float, weight: float) -> None:
        self.value = x if self.count == 0 else (1 - weight) * self.value + weight * x
        self.count += 1


class StepCosts:
    """Seconds per pure decode step, by batch size: with speculation (a verify step, or on a GPU a step whose
    next one waits for its tokens) and without. Their quotient is the tokens per verify step that break even."""

    def __init__(self):
        self._spec: dict[int, _Mean] = {}
        self._plain: dict[int, _Mean] = {}
        self._spec_since_plain: dict[int, int] = {}

    def observe(self, num_seqs: int, speculative: bool, seconds: float) -> None:
        means = self._spec if speculative else self._plain
        means.setdefault(num_seqs, _Mean()).add(seconds, COST_WEIGHT)
        since = self._spec_since_plain.get(num_seqs, 0)
        self._spec_since_plain[num_seqs] = since + 1 if speculative else 0

    def ratio(self, num_seqs: int) -> float | None:
        """A verify step's cost over a plain step's at this batch size; None until both are measured."""
        spec, plain = self._spec.get(num_seqs), self._plain.get(num_seqs)
        if spec is None or plain is None or min(spec.count, plain.count) < MIN_COST_SAMPLES:
            return None
        return spec.value / plain.value

    def ratios(self) -> dict[int, float]:
        """ratio() of every batch size where it is measured."""
        return {n: r for n in sorted(self._spec) if (r := self.ratio(n)) is not None}

    def wants_plain_step(self, num_seqs: int) -> bool:
        """Whether the next step of this size should run without speculation so that its cost is timed: the
        speculative cost is known, the plain one not yet or not lately."""
        spec, plain = self._spec.get(num_seqs), self._plain.get(num_seqs)
        if spec is None or spec.count < MIN_COST_SAMPLES:
            return False
        return plain is None or plain.count < MIN_COST_SAMPLES or self._spec_since_plain[num_seqs] >= PLAIN_EVERY


@dataclass
class _Track:
    tokens: _Mean                        # tokens per verify step since it (re)started speculating
    backoff: int = MIN_BACKOFF_STEPS     # the next back-off's length (doubles while its drafts keep not paying)
    resume_at: int = 0                   # the step from which it may speculate again


class SpeculationPolicy:
    """`waiting_is_free`: the device runs each step on the calling thread (the CPU), so reading a step before
    scheduling the next costs nothing and a step that drafted nothing is a plain step; on a GPU it costs the
    overlap of the host's work with the device's, so it is a verify step that kept no draft."""

    def __init__(self, config: SpeculativeConfig, waiting_is_free: bool = False):
        self.config = config
        self.waiting_is_free = waiting_is_free
        self.costs = StepCosts()
        self.step = 0
        self._tracks: dict[str, _Track] = {}

    def speculates_at(self, num_seqs: int) -> bool:
        """Whether a batch of this size may speculate at all (and so whether its step costs are worth timing)."""
        return num_seqs < self.config.disable_by_batch_size

    def on_schedule(self, num_running: int) -> bool:
        """A new step: whether anyone may speculate in it. Not in a large batch, nor in a step that times the
        plain cost of this batch size."""
        self.step += 1
        return self.speculates_at(num_running) and not self.costs.wants_plain_step(num_running)

    def allows(self, request_id: str) -> bool:
        track = self._tracks.get(request_id)
        return track is None or self.step >= track.resume_at

    def is_speculative(self, drafted: bool, speculating: bool) -> bool:
        """Whether a step costs what speculation costs: it verifies drafts, or a request in it speculates and the
        next step waits for its tokens where waiting is not free."""
        return drafted or (speculating and not self.waiting_is_free)

    def record(self, request_id: str, num_drafted: int, num_accepted: int, num_seqs: int) -> None:
        """A speculating request's step of `num_seqs` sequences came back: it drafted num_drafted tokens (maybe
        none: nothing to look up) and kept num_accepted of them."""
        if not self.is_speculative(num_drafted > 0, speculating=True):
            return
        track = self._tracks.setdefault(request_id, _Track(_Mean()))
        track.tokens.add(1 + num_accepted, TOKENS_WEIGHT)
        if track.tokens.count < JUDGE_AFTER:
            return
        ratio = self.costs.ratio(num_seqs)
        if track.tokens.value >= (UNMEASURED_COST_RATIO if ratio is None else ratio):
            track.backoff = MIN_BACKOFF_STEPS
            return
        track.tokens = _Mean()
        track.resume_at = self.step + track.backoff
        track.backoff = min(2 * track.backoff, MAX_BACKOFF_STEPS)

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
