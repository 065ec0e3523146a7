"""Tool calls through a replica's HTTP app and the real `openai` SDK, over an engine that writes given texts (no
model): `message.tool_calls` and `finish_reason: "tool_calls"`, the streamed `delta.tool_calls` adding up (as the
SDK adds them) to the same calls as the answer sent whole, for each of n=2 choices."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from engine.sequence import RequestMetrics
from engine.validation import check_request
from tests.app.fake_engine import FakeCompletion, FakeEngine, FakeOutput

MODEL = "fake-model"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "The weather in Paris and Rome, and the time?"}]
HERMES_TWO_CALLS = ('I will look these up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
HERMES_ONE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome \\"centro\\""}}\n</tool_call>'


class ScriptedEngine(FakeEngine):
    """Writes `texts[i]` as choice i, a few characters per step, then stops (finish_reason "stop")."""

    def __init__(self, texts: list[str], piece: int = 3):
        super().__init__(max_model_len=2048)
        self.texts, self.piece = texts, piece
        self.prompts: list[str] = []

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        sp = check_request(prompt_token_ids, sampling_params, self.max_model_len, self.model_config.vocab_size)
        self.sampling_params.append(sp)
        self.prompts.append(self.tokenizer.decode(prompt_token_ids))
        pieces = [[text[i:i + self.piece] for i in range(0, len(text), self.piece)] for text in self.texts[:sp.n]]
        metrics = RequestMetrics(arrival_time=time.time(), first_scheduled_time=time.time(),
                                 first_token_time=time.time())
        for step in range(max(len(p) for p in pieces)):
            await asyncio.sleep(0)
            delta = FakeOutput(request_id, prompt, prompt_token_ids, metrics=metrics)
            for i, choice in enumerate(pieces):
                if step < len(choice):
                    last = step == len(choice) - 1
                    delta.outputs.append(FakeCompletion(i, choice[step], list(choice[step].encode()), None,
                                                        finish_reason="stop" if last else None))
            delta.finished = step == max(len(p) for p in pieces) - 1
            if delta.finished:
                metrics.finished_time = time.time()
            yield delta


def sdk_client(engine: ScriptedEngine, **settings) -> openai.AsyncOpenAI:
    """The real SDK over the replica's app (app/deployment.py build_replica_app) on `engine`."""
    app = build_replica_app(engine, ServeArgs(model=MODEL, **settings), ReplicaObservability(engine, MODEL))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


async def whole_and_streamed(client: openai.AsyncOpenAI, **request):
    """The choices of one request answered whole, then streamed (added up by the SDK's stream helper)."""
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **request)
    async with client.chat.completions.stream(model=MODEL, messages=MESSAGES, **request) as stream:
        streamed = await stream.get_final_completion()
    return whole.choices, streamed.choices


async def test_auto_reads_hermes_calls_whole_and_streamed_with_two_choices():
    client = sdk_client(ScriptedEngine([HERMES_TWO_CALLS, HERMES_ONE_CALL]), enable_auto_tool_choice=True,
                        tool_call_parser="hermes")
    whole, streamed = await whole_and_streamed(client, tools=[WEATHER, TIME], n=2)
    assert calls_of(whole[0].message) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert whole[0].message.content == "I will look these up."
    assert calls_of(whole[1].message) == [("get_weather", '{"city": "Rome \\"centro\\""}')]
    assert whole[1].message.content is None
    for choice in whole:
        assert choice.finish_reason == "tool_calls"
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in choice.message.tool_calls)
    for w, s in zip(whole, streamed, strict=True):
        assert (calls_of(s.message), s.message.content, s.finish_reason) == \
               (calls_of(w.message), w.message.content, w.finish_reason)


async def test_auto_without_a_call_is_plain_content():
    client = sdk_client(ScriptedEngine(["Sunny all week."]), enable_auto_tool_choice=True, tool_call_parser="hermes")
    whole, streamed = await whole_and_streamed(client, tools=[WEATHER])
    for choice in whole + streamed:
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == \
               ("Sunny all week.", None, "stop")


async def test_required_calls_come_from_the_constrained_array():
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    client = sdk_client(ScriptedEngine([text, text]))  # no auto flag: required does not need it
    whole, streamed = await whole_and_streamed(client, tools=[WEATHER, TIME], tool_choice="required", n=2)
    for choice in whole + streamed:
        assert calls_of(choice.message) == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
        assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")


async def test_a_named_function_call_is_the_whole_output():
    client = sdk_client(ScriptedEngine(['{"city": "Lima"}']))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed = await whole_and_streamed(client, tools=[WEATHER, TIME], tool_choice=choice)
    for c in whole + streamed:
        assert calls_of(c.message) == [("get_weather", '{"city": "Lima"}')] and c.finish_reason == "tool_calls"


async def test_streamed_fragments_are_openais_first_a_header_then_arguments():
    client = sdk_client(ScriptedEngine([HERMES_ONE_CALL], piece=4), enable_auto_tool_choice=True,
                        tool_call_parser="hermes")
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True)
    fragments = [f for chunk in [c async for c in stream] for choice in chunk.choices
                 for f in choice.delta.tool_calls or []]
    header, *rest = fragments
    assert (header.index, header.type, header.function.name, header.function.arguments) == \
           (0, "function", "get_weather", "")
    assert header.id.startswith("call_") and rest
    assert all(f.id is None and f.function.name is None and f.index == 0 for f in rest)
    assert "".join(f.function.arguments for f in rest) == '{"city": "Rome \\"centro\\""}'


async def test_parallel_tool_calls_false_keeps_one_call():
    client = sdk_client(ScriptedEngine([HERMES_TWO_CALLS]), enable_auto_tool_choice=True, tool_call_parser="hermes")
    whole, streamed = await whole_and_streamed(client, tools=[WEATHER, TIME], parallel_tool_calls=False)
    for choice in whole + streamed:
        assert calls_of(choice.message) == [("get_weather", '{"city": "Paris"}')]


async def test_a_tool_history_is_accepted_and_rendered_for_the_engine():
    engine = ScriptedEngine(["It is 18 C in Paris."])
    client = sdk_client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    reply = await client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    assert reply.choices[0].message.content == "It is 18 C in Paris."
    [prompt] = engine.prompts  # the fake tokenizer's template cannot show tools: the default rendering
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
    assert engine.sampling_params[0].structured_outputs is None  # auto is not constrained
