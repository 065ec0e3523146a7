"""Tool calls read from a model's text (app/tool_calls/): the hermes and llama3_json parsers of `auto`, the JSON
that `required` and a named function are constrained to, and the streamed fragments, which must reassemble to
exactly the calls of the same text read whole."""

from __future__ import annotations

import json

import pytest

from app.tool_calls.parsers import HermesParser, Llama3JsonParser, NamedCallParser, RequiredCallsParser
from app.tool_calls.streaming import ChoiceToolCalls, finish_reason, whole_message

WEATHER_ARGS = '{"city": "Pa\\"ris }", "days": [1, {"n": "]"}], "metric": true}'


def read_whole(parser, text: str, max_calls: int | None = None):
    """(content, [(name, arguments)]) of the whole text."""
    content, calls = whole_message(ChoiceToolCalls(parser, max_calls), text)
    return content, [(c.function.name, c.function.arguments) for c in calls] if calls is not None else None


def read_streamed(parser, text: str, piece: int, max_calls: int | None = None):
    """The same, from the fragments of the text streamed `piece` characters at a time, as a client adds them up."""
    choice = ChoiceToolCalls(parser, max_calls)
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    content, calls = "", {}
    for i, part in enumerate(pieces):
        text_part, fragments = choice.delta(part, finished=i == len(pieces) - 1)
        content += text_part
        for fragment in fragments:
            if fragment.id is not None:
                calls[fragment.index] = [fragment.function.name, fragment.function.arguments]
            else:
                calls[fragment.index][1] += fragment.function.arguments
    if not calls:
        return content, None
    return content or None, [tuple(call) for call in calls.values()]


def test_hermes_reads_a_call_and_keeps_its_arguments_text_as_written():
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
    assert read_whole(HermesParser(), text) == (None, [("get_weather", WEATHER_ARGS)])
    assert json.loads(WEATHER_ARGS)["city"] == 'Pa"ris }'  # escapes and brackets inside strings did not end it


def test_hermes_reads_several_calls_and_the_text_before_them():
    text = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')
    assert read_whole(HermesParser(), text) == (
        "Let me look both up.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


def test_hermes_reads_the_name_after_the_arguments_and_no_arguments_as_an_empty_object():
    assert read_whole(HermesParser(), '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>') == (
        None, [("f", '{"a": 1}')])
    assert read_whole(HermesParser(), '<tool_call>{"name": "now"}</tool_call>') == (None, [("now", "{}")])


@pytest.mark.parametrize("text", [
    "Just an answer, no call.\n",
    "x <tool_call>not json</tool_call> y",
    '<tool_call>{"nam": "f", "arguments": {}}</tool_call>',
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    "<tool_c",
])
def test_hermes_gives_text_that_is_not_a_call_back_as_content(text):
    assert read_whole(HermesParser(), text) == (text, None)


def test_hermes_call_cut_short_keeps_the_arguments_written_so_far():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    assert read_whole(HermesParser(), text) == (None, [("get_weather", '{"city": "Pa')])


def test_llama3_json_reads_calls_after_the_python_tag_or_alone():
    assert read_whole(Llama3JsonParser(), '<|python_tag|>{"name": "f", "parameters": {"x": 1}}') == (
        None, [("f", '{"x": 1}')])
    assert read_whole(Llama3JsonParser(), '  {"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", '
                                          '"parameters": {}}') == (None, [("f", '{"x": [1, 2]}'), ("g", "{}")])


@pytest.mark.parametrize("text", ["The answer is 4.", 'Hello {"name": "f"}', '{"nam": 1}', "<|py"])
def test_llama3_json_reply_that_is_not_a_call_is_content(text):
    assert read_whole(Llama3JsonParser(), text) == (text, None)


def test_required_calls_are_read_from_the_constrained_array():
    text = '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": "]"}}]'
    assert read_whole(RequiredCallsParser(), text) == (None, [("f", '{"x": 1}'), ("g", '{"y": "]"}')])
    assert read_whole(RequiredCallsParser(), "not the array") == ("not the array", None)


def test_a_named_call_is_the_whole_output():
    assert read_whole(NamedCallParser("f"), ' {"x": {"y": [1, "}"]}} ') == (None, [("f", '{"x": {"y": [1, "}"]}}')])


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert read_whole(HermesParser(), text, max_calls=1) == (None, [("f", "{}")])
    assert read_streamed(HermesParser(), text, 3, max_calls=1) == (None, [("f", "{}")])


STREAMED_CASES = [
    (HermesParser, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}\n</tool_call>\n"
                   '<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>\n\nDone.'),
    (HermesParser, "x <tool_call>not json</tool_call> y\n"),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": "cut'),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": ' + WEATHER_ARGS + '}; {"name": "g", "parameters": 5}'),
    (Llama3JsonParser, "no call here"),
    (RequiredCallsParser, '[{"name": "f", "arguments": ' + WEATHER_ARGS + '}, {"name": "g", "arguments": {}}]'),
    (lambda: NamedCallParser("f"), WEATHER_ARGS),
]


@pytest.mark.parametrize("piece", [1, 2, 5, 11])
@pytest.mark.parametrize(("parser", "text"), STREAMED_CASES)
def test_streamed_fragments_reassemble_to_the_calls_read_whole(parser, text, piece):
    assert read_streamed(parser(), text, piece) == read_whole(parser(), text)


def test_fragments_have_openais_shape():
    choice = ChoiceToolCalls(HermesParser())
    _, first = choice.delta('<tool_call>{"name": "f", "arguments": {"a"')
    _, rest = choice.delta(": 1}}</tool_call>", finished=True)
    header, *pieces = [f.model_dump() for f in first + rest]
    assert header["id"].startswith("call_") and len(header["id"]) == len("call_") + 24
    assert header == {"index": 0, "id": header["id"], "type": "function", "function": {"name": "f", "arguments": ""}}
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces)
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"a": 1}'


def test_finish_reason_is_tool_calls_only_for_calls_that_ended():
    assert finish_reason("stop", num_calls=1) == "tool_calls"
    assert finish_reason("stop", num_calls=0) == "stop"
    assert finish_reason("length", num_calls=1) == "length"
