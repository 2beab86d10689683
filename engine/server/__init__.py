"""The engine's HTTP server: an OpenAI-compatible API (chat, completions, responses, models) plus /health, /stats,
/metrics, /version, /tokenize and /detokenize, on aiohttp, in front of AsyncLLM.

| file            | holds                                                                       |
|-----------------|-----------------------------------------------------------------------------|
| cli.py          | the flags: EngineArgs' vLLM flags plus ServerArgs' (--host, --port, ...)   |
| serve.py        | start-up: logging, the engine, the listening socket, signals, shutdown      |
| app.py          | the aiohttp app: routes, middlewares, shared state; the small GET routes    |
| middleware.py   | access log, errors -> OpenAI-shaped JSON, the Host/Origin guard, CORS       |
| auth.py         | the Bearer API key on /v1, the launcher's proxy key, who is privileged      |
| origin_policy.py| Host, Origin and request-target rules (standard library: the proxy's too)  |
| errors.py       | the OpenAI error body and the HTTP-only errors (401, 404 model)             |
| protocol.py     | request bodies -> typed fields and SamplingParams                           |
| defaults.py     | default sampling parameters (generation_config.json, as vLLM's auto mode)   |
| state.py        | ServerState: what every handler shares; the shutdown drain                  |
| serving.py      | one generation (n choices, best_of): admission, streaming or collecting      |
| chat.py         | POST /v1/chat/completions                                                   |
| completions.py  | POST /v1/completions (prompt lists, echo)                                   |
| responses.py    | POST /v1/responses (on the chat path), GET and DELETE /v1/responses/{id}    |
| responses_protocol.py | Responses input items, tools, text.format -> chat messages, tools, constraint |
| responses_items.py | a Response's output items and the stream events that build them          |
| response_store.py | stored responses for previous_response_id (in memory, bounded)            |
| reasoning.py    | --reasoning-parser: reasoning_content split at </think>, whole and streamed |
| tools.py        | tools / tool_choice: checks, and the grammar that forces tool calls         |
| tool_parser.py  | the hermes tool-call parser, whole and streamed                             |
| structured.py   | response_format / structured_outputs / guided_* -> StructuredOutputsParams  |
| tokenize.py     | POST /tokenize and /detokenize                                              |
| logprobs.py     | engine logprobs -> the two OpenAI logprobs shapes                           |
| sse.py          | the Server-Sent Events writer                                               |
| metrics.py      | Prometheus text for /metrics                                                |
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    # Imported here so that `python -m engine --help` parses flags without importing torch.
    from engine.server.serve import run
    run(argv)
