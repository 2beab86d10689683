"""The server in-process: engine failures a real tiny model cannot be made to produce on demand (a step that
crashes mid-stream, a dead engine loop, a bug), through the real aiohttp app with a scripted stand-in for
AsyncLLM; and the sampling defaults read from generation_config.json."""
from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

from engine.async_llm import ModelInfo
from engine.errors import EngineError, EngineOverloadedError
from engine.inputs.types import ProcessedPrompt
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.server.app import build_app
from engine.server.cli import ServerArgs
from engine.server.defaults import SamplingDefaults, load_sampling_defaults
from engine.server.state import ServerState

MODEL = "scripted"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def output(text: str, finished: bool = False, reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(index=0, text=text, token_ids=[7], finish_reason=reason, text_delta=text,
                                  token_ids_delta=[7])
    return RequestOutput("r", None, [1, 2, 3], [completion], finished, RequestMetrics(arrival_time=0.0))


class ScriptedLLM:
    """Plays back `script` (outputs, or an exception to raise) for every request."""

    def __init__(self, script: list, healthy: bool = True):
        self.script = script
        self.released: list[str] = []
        self.is_healthy = healthy
        self.dead_error = None if healthy else RuntimeError("CUDA error: an illegal memory access")
        self.model_info = ModelInfo(MODEL, max_model_len=64, vocab_size=100, multimodal=False,
                                    max_images_per_prompt=0, demo_model=False)

    def token_text(self, token_id: int) -> str:
        return "x"

    async def process_chat(self, messages, add_generation_prompt=True, chat_template_kwargs=None, start=None,
                           **options):
        return ProcessedPrompt(prompt_token_ids=[1, 2, 3])      # generate() plays the script, started or not

    def check_request(self, prompt, params) -> int:
        return params.max_tokens

    def check_room(self, past_queue_limit=False) -> None:
        pass

    def queue_position(self, request_id) -> None:
        return None

    def admission_stats(self) -> dict:
        return {"num_pending": 0, "max_waiting_requests": None, "num_refused_queue_full": 0}

    def release(self, request_id) -> None:
        self.released.append(request_id)

    async def wait_admitted(self, request_id) -> None:
        await asyncio.Event().wait()     # never says "queued": each stream's first output (or error) comes first

    async def generate(self, request_id, prompt, params, priority=0, past_queue_limit=False):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item


def app_around(llm: ScriptedLLM) -> tuple[ServerState, TestServer]:
    server_args = ServerArgs(host="127.0.0.1", port=0, api_key=None, log_file=None, max_request_body_mb=1.0,
                             generation_config="vllm", disable_access_log=False, disable_log_requests=False)
    state = ServerState(engine=llm, served_model_name=MODEL, model_path=MODEL, sampling_defaults=SamplingDefaults())
    return state, TestServer(build_app(state, server_args))


def call(llm: ScriptedLLM, method: str, path: str, body: dict | None = None) -> tuple[int, str, str]:
    """(status, content type, body text) of one request to a fresh app around `llm`."""
    async def run():
        _, server = app_around(llm)
        async with TestClient(server) as client:
            resp = await client.request(method, path, json=body)
            return resp.status, resp.headers["Content-Type"], await resp.text()
    return asyncio.run(run())


def test_error_after_the_stream_began_is_an_event_then_done():
    llm = ScriptedLLM([output("Hel"), EngineError("generation failed: RuntimeError: boom", code="step_failed")])
    status, ctype, text = call(llm, "POST", "/v1/chat/completions", {**CHAT_BODY, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert [json.loads(e)["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""},
                                                                          {"content": "Hel"}]
    error = json.loads(events[2])["error"]
    assert error["code"] == "step_failed" and "boom" in error["message"]
    assert events[3:] == ["[DONE]"]


def test_a_dead_engine_answers_503():
    llm = ScriptedLLM([EngineOverloadedError("the engine loop is not running", code="engine_dead")],
                      healthy=False)
    status, _, text = call(llm, "GET", "/health")
    assert status == 503 and "illegal memory access" in json.loads(text)["error"]["message"]
    for stream in (False, True):     # the first output is awaited before the stream starts: a real status
        status, ctype, text = call(llm, "POST", "/v1/chat/completions", {**CHAT_BODY, "stream": stream})
        assert status == 503 and ctype.startswith("application/json")
        assert json.loads(text)["error"]["type"] == "service_unavailable"


def test_a_bug_is_a_json_500_not_a_traceback():
    status, ctype, text = call(ScriptedLLM([RuntimeError("a bug")]), "POST", "/v1/chat/completions", CHAT_BODY)
    assert status == 500 and ctype.startswith("application/json")
    error = json.loads(text)["error"]
    assert error["code"] == "internal_error" and "a bug" in error["message"]


def test_a_finished_stream_ends_with_done():
    llm = ScriptedLLM([output("Hi"), output("!", finished=True, reason="stop")])
    status, _, text = call(llm, "POST", "/v1/chat/completions",
                           {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}})
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "stop"]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 1
    assert events[-1] == "[DONE]"


class EndlessLLM(ScriptedLLM):
    """Sends one chunk, then nothing more: a long generation whose client leaves mid-stream."""

    def __init__(self):
        super().__init__([])
        self.left: list[str] = []        # requests whose output iterator was left

    async def generate(self, request_id, prompt, params, priority=0, past_queue_limit=False):
        try:
            yield output("Hel")
            await asyncio.Event().wait()
        finally:
            self.left.append(request_id)


def test_a_handler_cancelled_twice_still_releases_its_request():
    """aiohttp may cancel a streaming handler again while it cleans up (a write fails as the client goes, then
    the lost connection cancels it): the request is still released (aborted in the engine), the cleanup is no
    500, and no task is left reading its outputs."""
    llm = EndlessLLM()

    async def run() -> str:
        state, server = app_around(llm)
        async with TestClient(server) as client:
            resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "stream": True})
            await resp.content.readline()                # the first event: the stream is on
            [(handler, request_id)] = state.generations.items()
            handler.cancel()
            await asyncio.sleep(0)                       # the handler is now inside its cleanup
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
            for _ in range(5):
                await asyncio.sleep(0)                   # cancelled readers unwind
            resp.close()
            return request_id
    request_id = asyncio.run(run())
    assert llm.released == [request_id] and llm.left == [request_id]


def test_sampling_defaults_follow_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 512,
         "repetition_penalty": "high"}))
    auto = load_sampling_defaults(str(tmp_path), "auto")
    assert (auto.temperature, auto.top_k, auto.top_p, auto.max_tokens) == (0.7, 20, 0.8, 512)
    assert auto.repetition_penalty == 1.0            # a malformed value is ignored, not fatal
    assert load_sampling_defaults(str(tmp_path), "vllm") == SamplingDefaults()
    assert load_sampling_defaults(str(tmp_path / "model.gguf"), "auto") == SamplingDefaults()
