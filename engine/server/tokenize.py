"""POST /tokenize and POST /detokenize, as vLLM has them: a prompt (or chat messages, rendered by the chat
template as /v1/chat/completions renders them) to token ids, and token ids back to text. The tokenizer runs on the
engine's input pool, under the prompt-text budgets a chat prompt meets, never on the event loop."""
from __future__ import annotations

from aiohttp import web

from engine.errors import InvalidInputError
from engine.server.errors import dumps
from engine.server.protocol import Fields, chat_template_options, read_json_body
from engine.server.state import STATE


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    f = Fields(await read_json_body(request, request.app[STATE].body_limits))
    state.check_model(f.string("model", None))
    if f.given("messages"):
        prompt = await state.engine.process_chat(f.body["messages"], tools=f.body.get("tools"),
                                                 **chat_template_options(f))
        ids = list(prompt.prompt_token_ids)
    else:
        text = f.string("prompt", None)
        if text is None:
            raise InvalidInputError("send prompt (a string) or messages", param="prompt")
        ids = await state.engine.encode(text, add_special_tokens=f.boolean("add_special_tokens", True))
    body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
    if f.boolean("return_token_strs", False):
        body["token_strs"] = await state.engine.convert_ids_to_tokens(ids)
    return web.json_response(body, dumps=dumps)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    f = Fields(await read_json_body(request, request.app[STATE].body_limits))
    state.check_model(f.string("model", None))
    ids = f.body.get("tokens")
    if not isinstance(ids, list):      # its items are checked off the event loop, with the decoding
        raise InvalidInputError("tokens (a list of token ids) is required" if ids is None else
                                "tokens must be a list of token ids", param="tokens")
    return web.json_response({"prompt": await state.engine.decode(ids)}, dumps=dumps)
