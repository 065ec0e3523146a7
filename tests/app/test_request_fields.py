"""What the routes make of the fields that constrain or steer an output (over a fake engine, no model): each
constraint field becomes the engine's one StructuredOutputsParams, logit_bias its token-id map, and everything
the server cannot honour is a 400 naming the field: two constraints, unsupported fields, wrong types (strict,
as OpenAI's), non-text content, and the engine's refusal of a constraint, named by the field the client used."""

from __future__ import annotations

import httpx
import pytest

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from app.tool_calls.plan import AUTO_NEEDS_FLAGS
from engine.errors import InvalidRequestError
from tests.app.fake_engine import FakeEngine

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=2048)  # room for the default tool rendering, a byte a token


@pytest.fixture
async def client(engine):
    app = build_replica_app(engine, ServeArgs(model=MODEL), ReplicaObservability(engine, MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def body(path: str, **fields) -> dict:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    return {"model": MODEL, "max_tokens": 2, **prompt, **fields}


async def sent_params(client, engine, path: str, **fields):
    """The SamplingParams the engine got for a request with these fields."""
    r = await client.post(path, json=body(path, **fields))
    assert r.status_code == 200, r.text
    return engine.sampling_params[-1]


async def refused(client, path: str, **fields) -> dict:
    """The error of a request with these fields (a 400), after which the server still serves."""
    r = await client.post(path, json=body(path, **fields))
    assert r.status_code == 400, r.text
    assert (await client.post(path, json=body(path))).status_code == 200
    return r.json()["error"]


# -- constraints ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "fields", "kind", "value"), [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    (CHAT, {"response_format": {"type": "json_object"}}, "json_object", True),
    (CHAT, {"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    (COMPLETIONS, {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json_schema", SCHEMA),
    (COMPLETIONS, {"guided_json": SCHEMA}, "json_schema", SCHEMA),
    (COMPLETIONS, {"guided_regex": "a|b"}, "regex", "a|b"),
    (CHAT, {"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    (CHAT, {"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
])
async def test_each_constraint_field_becomes_the_engines_structured_outputs(client, engine, path, fields, kind,
                                                                              value):
    constraint = (await sent_params(client, engine, path, **fields)).structured_outputs
    assert getattr(constraint, kind) == value
    assert constraint.kinds() == ["json" if kind == "json_schema" else kind]
    assert constraint.disable_any_whitespace == ("disable_any_whitespace" in str(fields))


async def test_text_response_format_and_no_fields_leave_the_output_free(client, engine):
    assert (await sent_params(client, engine, CHAT, response_format={"type": "text"})).structured_outputs is None
    assert (await sent_params(client, engine, CHAT)).structured_outputs is None


async def test_two_constraints_are_a_400_naming_the_second(client):
    error = await refused(client, CHAT, response_format={"type": "json_object"}, guided_regex="a+")
    assert error["param"] == "guided_regex" and "`response_format` and `guided_regex`" in error["message"]
    error = await refused(client, CHAT, tools=[WEATHER], tool_choice="required", guided_json=SCHEMA)
    assert error["param"] == "tools"


@pytest.mark.parametrize(("path", "fields", "param"), [
    (COMPLETIONS, {"guided_json": {"type": "object"}}, "guided_json"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     "response_format"),
    (CHAT, {"structured_outputs": {"regex": "("}}, "structured_outputs"),
    (CHAT, {"tools": [WEATHER], "tool_choice": "required"}, "tools"),
])
async def test_a_constraint_the_engine_refuses_is_a_400_naming_the_field_sent(client, engine, path, fields, param):
    engine.fail_with = InvalidRequestError("the grammar does not compile", param="structured_outputs")
    error = await refused(client, path, **fields)
    assert (error["param"], error["message"]) == (param, "the grammar does not compile")


async def test_malformed_structured_outputs_are_refused_before_the_engine(client, engine):
    assert (await refused(client, CHAT, structured_outputs={"regex": "a", "choice": ["a"]}))["param"] == \
        "structured_outputs"
    assert (await refused(client, CHAT, structured_outputs={"regex": "a", "backend": "x"}))["param"] == \
        "structured_outputs"
    assert (await refused(client, COMPLETIONS, guided_choice=[]))["param"] == "guided_choice"


# -- tool_choice ----------------------------------------------------------------------------------


async def test_required_decodes_under_an_array_of_the_tools_calls(client, engine):
    schema = (await sent_params(client, engine, CHAT, tools=[WEATHER, TIME], tool_choice="required"))\
        .structured_outputs.json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"] == {"name": {"const": "get_weather"}, "arguments": SCHEMA}
    assert time["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert weather["required"] == ["name", "arguments"] and weather["additionalProperties"] is False
    one = (await sent_params(client, engine, CHAT, tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False)).structured_outputs.json_schema
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "get_weather"}


async def test_a_named_function_decodes_under_its_parameters(client, engine):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    params = await sent_params(client, engine, CHAT, tools=[WEATHER, TIME], tool_choice=choice)
    assert params.structured_outputs.json_schema == SCHEMA


async def test_tool_choice_none_leaves_the_output_free(client, engine):
    assert (await sent_params(client, engine, CHAT, tools=[WEATHER], tool_choice="none")).structured_outputs is None


@pytest.mark.parametrize("fields", [{"tool_choice": "auto"}, {}])
async def test_auto_without_the_servers_flag_is_vllms_400(client, fields):
    error = await refused(client, CHAT, tools=[WEATHER], **fields)
    assert (error["param"], error["message"]) == ("tool_choice", AUTO_NEEDS_FLAGS)


async def test_tool_choice_naming_a_missing_function_is_a_400(client):
    error = await refused(client, CHAT, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    assert error["param"] == "tool_choice" and "`x`" in error["message"] and "`get_weather`" in error["message"]
    assert (await refused(client, CHAT, tool_choice="required"))["param"] == "tool_choice"  # and no tools at all
    assert (await refused(client, CHAT, tools=[WEATHER, WEATHER], tool_choice="required"))["param"] == "tools"


# -- logit_bias -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_logit_bias_reaches_the_engine_by_token_id(client, engine, path):
    assert (await sent_params(client, engine, path, logit_bias={"97": 5, "98": -100.0})).logit_bias == \
        {97: 5.0, 98: -100.0}


@pytest.mark.parametrize("logit_bias", [{"a": 1}, {"-1": 1}, {"97": 101}, {"97": "1"}, {"300": 1}])
async def test_bad_logit_bias_is_a_400(client, logit_bias):
    assert (await refused(client, COMPLETIONS, logit_bias=logit_bias))["param"] == "logit_bias"


# -- fields that are refused, or accepted as changing nothing -------------------------------------------


@pytest.mark.parametrize(("path", "field", "value"), [
    (COMPLETIONS, "best_of", 3),
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "web_search_options", {}),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "chat_template_kwargs", {"enable_thinking": True}),
    (COMPLETIONS, "use_beam_search", True),
    (COMPLETIONS, "prompt_logprobs", 1),
    (CHAT, "echo", True),
    (COMPLETIONS, "include_stop_str_in_output", True),
])
async def test_a_known_field_that_is_not_implemented_is_a_400_naming_it(client, path, field, value):
    error = await refused(client, path, **{field: value})
    assert error["param"] == field and f"`{field}`" in error["message"]


async def test_completion_logprobs_past_20_are_a_400(client):
    assert (await refused(client, COMPLETIONS, logprobs=21))["param"] == "logprobs"


@pytest.mark.parametrize(("path", "fields"), [
    (COMPLETIONS, {"best_of": 1}),
    (COMPLETIONS, {"best_of": 2, "n": 2}),
    (CHAT, {"modalities": ["text"], "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": False, "audio": None, "functions": None}),
])
async def test_fields_that_change_nothing_are_accepted(client, path, fields):
    assert (await client.post(path, json=body(path, **fields))).status_code == 200


async def test_a_non_text_content_part_is_a_400_naming_messages(client):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    error = await refused(client, CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "?"}, image]}])
    assert error["param"] == "messages" and "image_url" in error["message"]


# -- strict types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "field", "value"), [
    (COMPLETIONS, "echo", 0),
    (CHAT, "top_logprobs", False),
    (CHAT, "logprobs", 1),
    (COMPLETIONS, "n", True),
    (COMPLETIONS, "max_tokens", "5"),
    (COMPLETIONS, "max_tokens", 5.0),
    (COMPLETIONS, "stream", 1),
    (COMPLETIONS, "temperature", True),
    (COMPLETIONS, "stop_token_ids", [True]),
    (CHAT, "stream_options", {"include_usage": 1}),
    (CHAT, "parallel_tool_calls", 0),
    (CHAT, "structured_outputs", {"json_object": 1}),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "strict": 1}}]),
])
async def test_booleans_and_integers_are_strict(client, path, field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    assert (await refused(client, path, **{field: value}, **extra))["param"] == field


async def test_a_float_field_still_takes_an_integer(client, engine):
    assert (await sent_params(client, engine, COMPLETIONS, temperature=1, top_p=1)).temperature == 1.0
