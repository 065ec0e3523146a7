"""One choice's tool calls in OpenAI's shapes: `delta.tool_calls` fragments as the text streams, or the whole
message's `tool_calls`, both from the same parser events (app/tool_calls/parsers.py), so the fragments of a
streamed answer reassemble to exactly the calls of the same answer sent whole."""

from __future__ import annotations

import uuid

from app.tool_calls.parsers import ArgumentsText, CallStart, ContentText, Event, ToolCallParser
from app.tool_calls.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceToolCalls:
    """A choice's parser, with the calls past `max_calls` left out (`parallel_tool_calls: false` allows one)."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls

    @property
    def num_calls(self) -> int:
        return min(self.parser.num_calls, self.max_calls or self.parser.num_calls)

    def delta(self, text: str, finished: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """The content and call fragments that a piece of the choice's text adds (the last piece: finished)."""
        events = self.parser.feed(text)
        if finished:
            events += self.parser.finish()
        return self._fragments(events)

    def _fragments(self, events: list[Event]) -> tuple[str, list[DeltaToolCall]]:
        content, fragments = "", []
        for event in events:
            if isinstance(event, ContentText):
                content += event.text
            elif self.max_calls is not None and event.index >= self.max_calls:
                continue
            elif isinstance(event, CallStart):  # OpenAI's first fragment of a call: arguments ""
                fragments.append(DeltaToolCall(index=event.index, id=tool_call_id(), type="function",
                                               function=DeltaFunctionCall(name=event.name, arguments="")))
            elif isinstance(event, ArgumentsText):
                fragments.append(DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text)))
        return content, fragments


def whole_message(calls: ChoiceToolCalls, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """The message content and tool calls of a choice's whole text (no calls: all of it is content)."""
    content, fragments = calls.delta(text, finished=True)
    tool_calls: dict[int, ToolCall] = {}
    for fragment in fragments:
        if fragment.id is not None:
            tool_calls[fragment.index] = ToolCall(id=fragment.id, function=FunctionCall(
                name=fragment.function.name, arguments=fragment.function.arguments))
        else:
            tool_calls[fragment.index].function.arguments += fragment.function.arguments
    if not tool_calls:
        return content, None
    return content or None, list(tool_calls.values())


def finish_reason(engine_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's `tool_calls` for a choice that ended its calls itself; a length cut stays `length`."""
    return "tool_calls" if engine_reason == "stop" and num_calls else engine_reason
