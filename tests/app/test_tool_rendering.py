"""A chat's tools and tool turns through the chat template (app/prompts.py, app/tool_calls/rendering.py): on a
template that renders tools (Qwen2.5-style, tests/app/tool_templates.py) as transformers passes them, and on one
that cannot (the tiny models' own, like the demo model's) with the default Hermes-style rendering."""

from __future__ import annotations

import pytest

from app.prompts import chat_prompt
from app.protocol import ChatCompletionRequest
from app.tool_calls.parsers import HermesParser
from app.tool_calls.rendering import renders_tools
from app.tool_calls.streaming import ChoiceToolCalls, whole_message
from engine.checkpoint.loader import load_tokenizer
from engine.errors import InvalidRequestError
from tests.app.tool_templates import QWEN2_STYLE_TOOLS_TEMPLATE

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "24 C"},
]
TOOLS_PROMPT = (
    '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>')
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
RESPONSES = "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n24 C\n</tool_response>"


def chat(messages, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def rendered(tokenizer, req: ChatCompletionRequest) -> str:
    return tokenizer.decode(chat_prompt(tokenizer, req).token_ids)


@pytest.fixture(scope="module")
def plain_tokenizer(tiny_llama_dir):
    """The tiny model's tokenizer, whose template (like SmolLM2's) cannot show tools."""
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def tools_tokenizer(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = QWEN2_STYLE_TOOLS_TEMPLATE  # what --chat-template does (app/model_defaults.py)
    return tokenizer


def test_templates_that_show_tools_are_told_apart(plain_tokenizer, tools_tokenizer):
    assert renders_tools(tools_tokenizer) and not renders_tools(plain_tokenizer)


def test_tool_history_renders_through_a_template_that_renders_tools(tools_tokenizer):
    text = rendered(tools_tokenizer, chat(HISTORY, tools=[WEATHER_TOOL]))
    # the template got the tools, the calls' arguments as objects (rendered by its `tojson`, not as strings),
    # and each tool turn, in the template's own format
    assert text == (
        "<s>system\nBe brief.\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML "
        f"tags:\n{TOOLS_PROMPT}\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call></s>\n'
        "<s>user\nWeather in Paris and Rome?</s>\n"
        f"<s>assistant\n{CALLS}</s>\n<s>user\n{RESPONSES}</s>\n<s>assistant\n")


def test_a_template_without_tools_gets_the_default_rendering(plain_tokenizer):
    text = rendered(plain_tokenizer, chat(HISTORY, tools=[WEATHER_TOOL]))
    assert text == (
        "<s>system\nBe brief.\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n{TOOLS_PROMPT}\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call></s>\n'
        "<s>user\nWeather in Paris and Rome?</s>\n"
        f"<s>assistant\n{CALLS}</s>\n<s>user\n{RESPONSES}</s>\n<s>assistant\n")


def test_the_hermes_parser_reads_back_the_calls_of_the_default_rendering():
    content, calls = whole_message(ChoiceToolCalls(HermesParser()), CALLS)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]


def test_default_rendering_adds_a_system_turn_when_the_chat_has_none(plain_tokenizer):
    text = rendered(plain_tokenizer, chat([{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL]))
    assert text.startswith("<s>system\nYou may call one or more functions") and TOOLS_PROMPT in text
    assert text.endswith("</tool_call></s>\n<s>user\nhi</s>\n<s>assistant\n")


def test_a_chat_without_tools_renders_as_its_messages_alone(plain_tokenizer, tools_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for tokenizer in (plain_tokenizer, tools_tokenizer):
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered(tokenizer, chat(messages)) == expected


def test_call_arguments_that_are_not_json_are_a_400_naming_messages(tools_tokenizer):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(InvalidRequestError) as refused:
        chat_prompt(tools_tokenizer, chat(history))
    assert refused.value.param == "messages" and "messages[1].tool_calls[0].function.arguments" in refused.value.message
