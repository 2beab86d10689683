"""POST /v1/completions: raw prompts (text or token ids, one or a list) in, a text_completion (or a stream of
them) out. Choice i * n + j is sample j of prompt i; `echo` puts the prompt before each choice's text."""
from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from aiohttp import web

from engine.async_llm import StartRequest
from engine.errors import InvalidInputError
from engine.outputs import RequestOutput
from engine.server.logprobs import completion_logprobs, prompt_logprobs_json
from engine.server.protocol import (check_token_ids_in_vocab, choice_counts, engine_logprobs, renamed_params,
                                    sampling_params, truncate_prompt_tokens)
from engine.server.serving import Generation, ResponseFormat, read_request, serve_generation, usage
from engine.server.state import ServerState
from engine.server.structured import parse_structured_outputs

DEFAULT_MAX_TOKENS = 16       # OpenAI's and vLLM's default for /v1/completions
MAX_PROMPTS = 64              # prompts in one request (each is n engine requests)


async def create_completion(request: web.Request) -> web.StreamResponse:
    state, f, options = await read_request(request)
    n, best_of = choice_counts(f, options)
    inputs = parse_prompts(f.body.get("prompt"))
    echo = f.boolean("echo", False)
    constraint, constraint_param = parse_structured_outputs(f)
    user_max = f.integer("max_tokens", None)
    logprobs = f.integer("logprobs", None)
    truncate = truncate_prompt_tokens(f, state.max_model_len)
    with renamed_params({"messages": "prompt", "multi_modal_data": "prompt"}):
        max_tokens = user_max if user_max is not None else DEFAULT_MAX_TOKENS
        params = sampling_params(f, state.sampling_defaults, max_tokens, engine_logprobs(logprobs, n, best_of),
                                 constraint)
        if echo and logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = logprobs          # echoed prompt tokens carry logprobs too, as vLLM's
        check_token_ids_in_vocab(params, state.vocab_size)
        if constraint is not None:
            await state.engine.compile_structured_output(params, constraint_param)
        fit = None if user_max is not None else state.fit_default_max_tokens
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # The first prompt starts as soon as it is processed; the others (own parameters: a default max_tokens
        # is fitted to each prompt) after.
        prompts = [(await state.engine.process_prompt(inputs[0], start=StartRequest(
            request_id, params, options.priority, fit, past_queue_limit=options.past_queue_limit),
                                                      truncate_prompt_tokens=truncate), params)]
        for prompt_input in inputs[1:]:
            prompt = await state.engine.process_prompt(prompt_input, truncate_prompt_tokens=truncate)
            own = copy.copy(params)
            if fit is not None:
                fit(prompt, own)
            prompts.append((prompt, own))
    gen = Generation(request_id, prompts[0][0], params, options, int(time.time()), n=n, best_of=best_of,
                     prompts=prompts)
    # echo: each prompt's text; a prompt sent as token ids is decoded (off the event loop) to give it. With
    # return_token_ids the prompt's ids stand for it and the echoed text is empty, as vLLM's.
    echoed = None
    if echo:
        echoed = [("" if options.return_token_ids else p.prompt if p.prompt is not None
                   else await state.engine.decode(p.prompt_token_ids)) for p, _ in prompts]
    return await serve_generation(request, state, gen, CompletionFormat(gen, state, logprobs, echoed))


def parse_prompts(value: Any) -> list[str | dict[str, Any]]:
    """A string, a list of token ids, or a list of either (OpenAI's batch form) -> the engine's prompt inputs."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [{"prompt_token_ids": value}]
        if len(value) > MAX_PROMPTS:
            raise InvalidInputError(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request",
                                    param="prompt")
        out = []
        for i, v in enumerate(value):
            if isinstance(v, str) and v:
                out.append(v)
            elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                out.append({"prompt_token_ids": v})
            else:
                raise InvalidInputError(f"prompt[{i}] must be a non-empty string or a non-empty list of token ids",
                                        param="prompt")
        return out
    if value is None:
        raise InvalidInputError("prompt is required: a string or a list of token ids", param="prompt")
    raise InvalidInputError("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


class CompletionFormat(ResponseFormat):
    chunk_object = "text_completion"

    def __init__(self, gen: Generation, state: ServerState, logprobs: int | None, echoed: list[str] | None):
        super().__init__(gen, state, logprobs)
        self.echoed = echoed            # echo: the text of each prompt, which goes before its choices' text
        self.echo = echoed is not None
        self.text_offset: dict[int, int] = {}    # per choice: characters already covered by streamed logprobs

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]] | None,
                  prompt: RequestOutput | None = None) -> dict | None:
        """`prompt`: also the prompt's tokens first (echo), the first of which has no logprob (null)."""
        if self.logprobs is None:
            return None
        ids, rows = [], []
        if prompt is not None:
            ids, rows = list(prompt.prompt_token_ids), [None] + list(prompt.prompt_logprobs or [])[1:]
        if token_ids and entries:
            ids, rows = ids + token_ids, rows + entries[-len(token_ids):]
        if not ids:
            return None
        result = completion_logprobs(ids, rows, self.logprobs, self.token_text, self.text_offset.get(index, 0))
        self.text_offset[index] = self.text_offset.get(index, 0) + sum(len(t) for t in result["tokens"])
        return result

    def _choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason          # vLLM's extension: the stop string or token id
        return choice

    def _token_ids(self, choice: dict, out: RequestOutput, token_ids: list[int], first: bool) -> dict:
        """return_token_ids: the choice's token ids (a stream's new ones), and its prompt's in its first chunk."""
        if self.gen.options.return_token_ids:
            if first:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = list(token_ids)
        return choice

    def _prompt_text(self, index: int) -> str:
        return self.echoed[index // self.gen.n]

    def chunk(self, out: RequestOutput, index: int) -> dict | None:
        c = out.outputs[0]
        first = index not in self.text_offset
        echo = self.echo and first
        logprobs = self._logprobs(index, c.token_ids_delta, c.logprobs, out if echo else None)
        text = (self._prompt_text(index) if echo else "") + c.text_delta
        token_ids = self.gen.options.return_token_ids and bool(c.token_ids_delta)
        if not text and c.finish_reason is None and logprobs is None and not token_ids:
            return None     # a token whose text is held back (a possible stop string) or not yet decodable
        self.text_offset.setdefault(index, 0)
        choice = self._choice(index, text, logprobs, c.finish_reason, c.stop_reason)
        return self.chunk_of(out, self._token_ids(choice, out, c.token_ids_delta, first))

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for index, final in enumerate(finals):
            c = final.outputs[0]
            logprobs = self._logprobs(index, c.token_ids, c.logprobs, final if self.echo else None)
            text = (self._prompt_text(index) if self.echo else "") + c.text
            choice = self._choice(index, text, logprobs, c.finish_reason, c.stop_reason)
            choice["prompt_logprobs"] = None if self.gen.params.prompt_logprobs is None else \
                prompt_logprobs_json(final.prompt_logprobs, self.state.token_text)
            choices.append(self._token_ids(choice, final, c.token_ids, True))
        return self.envelope("text_completion", choices, usage=usage(finals, len(self.gen.prompts)))
