"""The offline API vLLM users know: LLM(model=...).generate(prompts, sampling_params) and .chat(messages)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.args import EngineArgs
from engine.errors import InvalidInputError
from engine.inputs.types import ProcessedPrompt
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        self.engine = LLMEngine(EngineArgs(model=str(model), **kwargs))

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes and the input threads (also done at interpreter exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a dict ({"prompt_token_ids": [...]} or {"prompt": ..., "multi_modal_data":
        {"image": ...}}), or a list of those. Returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict, ProcessedPrompt)):
            prompts = [prompts]
        processed = [self.engine.process_prompt(p) for p in prompts]   # validate all before running any
        return self._run(processed, sampling_params, priority)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one OpenAI-style conversation (a list of {"role", "content"}) or a list of conversations;
        tools: OpenAI function tools, shown to the model by its chat template; mm_processor_kwargs: how its
        images and videos are processed (fps, num_frames, max_frames, size, min_pixels, max_pixels)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("messages must be a non-empty list", param="messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        processed = [self.engine.input_processor.process_chat(c, add_generation_prompt, chat_template_kwargs,
                                                              tools=tools, mm_processor_kwargs=mm_processor_kwargs)
                     for c in conversations]
        return self._run(processed, sampling_params, None)

    def _run(self, processed, sampling_params, priority) -> list[RequestOutput]:
        n = len(processed)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise InvalidInputError(f"{len(params)} sampling_params for {n} prompts", param="sampling_params")
        priority = list(priority) if priority is not None else [0] * n
        ids = []
        try:
            for p, sp, prio in zip(processed, params, priority):
                ids.append(self.engine.add_request(None, p, sp, priority=prio).request_id)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
