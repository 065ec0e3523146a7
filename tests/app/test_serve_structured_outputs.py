"""Structured outputs and tool calls end to end: the tiny random-weight Llama behind Ray Serve, the real `openai`
SDK, the engine's grammar mask (engine/structured_output/).

A random model writes valid JSON only because the mask lets nothing else through, so every output below that
parses and validates (with `jsonschema`) is the mask at work; a control request without the constraint shows
that the same model otherwise does not. The server renders tools with a Qwen2.5-style template
(--chat-template) and reads `auto` calls with the hermes parser.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.app.conftest import API_KEY, SERVED_NAME, tiny_serve_args
from tests.app.tool_templates import QWEN2_STYLE_TOOLS_TEMPLATE

ROUTE = "/structured"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
# a hermes block the model is made to write (regex), for the auto parser to read back
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    high_c: int = Field(ge=-30, le=45)
    rain: bool
    winds: list[Literal["north", "south"]] = Field(min_length=1, max_length=2)
    note: str | None = Field(max_length=12)


@pytest.fixture(scope="module")
def base_url(serve_cluster, tiny_llama_dir) -> str:
    from ray import serve

    from app.deployment import build_app

    args = tiny_serve_args(tiny_llama_dir, max_model_len=1024, chat_template=QWEN2_STYLE_TOOLS_TEMPLATE,
                           enable_auto_tool_choice=True, tool_call_parser="hermes")
    serve.run(build_app(args), name="structured", route_prefix=ROUTE)
    yield serve_cluster.url(f"{ROUTE}/v1")
    serve.delete("structured")


@pytest.fixture
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)


def calls_of(choice) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]


def whole_and_streamed(client: openai.OpenAI, **request):
    """The choices of one seeded request answered whole, then streamed (added up by the SDK's stream helper)."""
    request = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 7,
               **request}
    whole = client.chat.completions.create(**request)
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion()
    return whole.choices, streamed.choices


def test_parse_returns_the_pydantic_model_that_only_the_mask_made_valid(client):
    request = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "The forecast for Rome?"}],
               "max_tokens": 200, "temperature": 1.0, "seed": 3, "n": 2}
    parsed = client.chat.completions.parse(response_format=Forecast, **request)
    for choice in parsed.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)
        jsonschema.validate(json.loads(choice.message.content), Forecast.model_json_schema())
    free = client.chat.completions.create(**request)  # the same request without the mask
    for choice in free.choices:
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(choice.message.content), Forecast.model_json_schema())


def test_required_tool_calls_validate_against_their_parameters_whole_and_streamed(client):
    whole, streamed = whole_and_streamed(client, tools=TOOLS, tool_choice="required", n=2)
    for choice in whole:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for name, arguments in calls_of(choice):
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert [calls_of(c) for c in streamed] == [calls_of(c) for c in whole]  # the same seed, the same tokens


def test_a_named_tool_call_validates_against_its_parameters_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole, streamed = whole_and_streamed(client, tools=TOOLS, tool_choice=named)
    [(name, arguments)] = calls_of(whole[0])
    assert name == "get_time" and whole[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), TIME_PARAMETERS)
    assert calls_of(streamed[0]) == calls_of(whole[0])


def test_auto_reads_the_hermes_call_that_the_model_wrote(client):
    whole, streamed = whole_and_streamed(client, tools=TOOLS, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    for choice in whole + streamed:
        [(name, arguments)] = calls_of(choice)
        assert name == "get_weather" and json.loads(arguments)["unit"] == "celsius"
        assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
    assert calls_of(streamed[0]) == calls_of(whole[0])


BAD_CONSTRAINTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock_price"}}}, "tool_choice"),
]


def test_bad_constraints_are_400s_naming_their_field_and_the_engine_serves_on(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as http:
        idle = http.get("/engine/stats").json()
        for fields, param in BAD_CONSTRAINTS:
            r = http.post("/chat/completions", json={"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8,
                                                     **fields})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        ok = http.post("/chat/completions", json={"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8,
                                                  "guided_choice": ["yes", "no"]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
        stats = http.get("/engine/stats").json()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == idle["num_free_blocks"]  # nothing refused held a block
