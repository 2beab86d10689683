"""From sampled token ids to what a user sees: incremental text, stop strings, finish reasons.

While a request runs, the last (longest stop string - 1) characters are held back, so a stop string that
arrives over several tokens is never half-streamed before it is cut. As in vLLM, stop strings are looked for only
once min_tokens tokens are out, and only in text that ends after them: the text of the first min_tokens tokens
is never cut.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.request import Request
from engine.inputs.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput


@dataclass
class _State:
    detok: IncrementalDetokenizer
    sent_chars: int = 0
    stopped_text: str | None = None      # final text when a stop string ended the request
    stop_floor: int = 0                  # characters of the first min_tokens tokens: a stop string ends past them


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens)
        self.states[req.request_id] = _State(detok)

    def on_tokens(self, req: Request, num_new: int, logprobs: list[dict[int, float]] | None) -> RequestOutput:
        """The request just got `num_new` more tokens (one, or a verify step's several; it may already be
        finished by a stop token or length). A stop string inside them ends the request there: the tokens
        after it are dropped, as one-token steps would never have made them."""
        st = self.states[req.request_id]
        now, m = time.time(), req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        new_ids = req.output_token_ids[len(req.output_token_ids) - num_new:]
        stops = req.sampling_params.stop_strings
        finished, text, kept = req.is_finished, st.detok.output_text, 0
        for i, token in enumerate(new_ids):
            kept = i + 1
            st.detok.add([token])
            if finished and kept == num_new:
                st.detok.flush()
            text = st.detok.output_text
            if stops and len(req.output_token_ids) - num_new + kept <= req.sampling_params.min_tokens:
                st.stop_floor = len(text)
            elif stops:
                cut = self._find_stop(req, text, st.sent_chars, st.stop_floor)
                if cut is not None:
                    text, finished = cut, True
                    st.stopped_text = text
                    break
        if kept < num_new:
            del req.output_token_ids[kept - num_new:], req.all_token_ids[kept - num_new:]
            new_ids = new_ids[:kept]
        if logprobs is not None:
            req.output_logprobs.extend(logprobs[:kept])
        hold = 0 if finished or not stops else max(len(s) for s in stops) - 1
        visible = max(st.sent_chars, len(text) - hold)
        delta = text[st.sent_chars:visible]
        st.sent_chars = visible
        return self._output(req, text[:visible], delta, new_ids, finished)

    def finish(self, req: Request) -> RequestOutput:
        """An aborted request: report what it had."""
        st = self.states.get(req.request_id)
        text = st.detok.output_text[:st.sent_chars] if st else ""
        return self._output(req, text, "", [], True)

    def _find_stop(self, req: Request, text: str, sent: int, floor: int) -> str | None:
        """The text cut at the first stop string that ends past both `sent` (what was already checked) and
        `floor` (the min_tokens text); None if there is none."""
        params = req.sampling_params
        best = None
        for s in params.stop_strings:
            idx = text.find(s, max(0, sent - len(s) + 1, floor - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        req.stop_reason = s
        return text[: idx + len(s)] if params.include_stop_str_in_output else text[:idx]

    def _output(self, req: Request, text: str, delta: str, delta_ids: list[int], finished: bool) -> RequestOutput:
        reason = None
        if finished:
            reason = "stop" if req.stop_reason is not None or not req.status.finished else req.status.value
            self.states.pop(req.request_id, None)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids), finish_reason=reason,
            stop_reason=req.stop_reason, text_delta=delta, token_ids_delta=delta_ids,
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None)
        return RequestOutput(req.request_id, req.prompt.prompt, req.prompt_token_ids, [completion], finished,
                             req.metrics, prompt_logprobs=req.prompt_logprobs)
