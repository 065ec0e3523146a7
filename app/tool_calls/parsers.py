"""Tool calls read from a model's text as it streams: `hermes` and `llama3_json` for `tool_choice: "auto"`
(vLLM's --tool-call-parser names), and the JSON that `required` and a named function are constrained to.

A parser turns text into events, in order: content text, the start of a call (its index and name), and pieces
of a call's arguments. The arguments are the raw text of the arguments value in the model's output, sent as
soon as it is scanned (app/tool_calls/json_scan.py), so a piece is never taken back: a streamed answer and the
same answer whole (the whole text fed at once) give the same calls. Text that turns out not to be a call before
its name is known comes back as content; a call whose name was sent stands, with the arguments read so far.

Content next to calls: whitespace is held back until more content follows it, and whitespace left at the end
is dropped when the text had calls (so a reply that is only calls has no content).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.tool_calls.json_scan import WHITESPACE, CallObjectScanner, JsonValueScanner

ToolCallParserName = Literal["hermes", "llama3_json"]


@dataclass
class ContentText:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class ArgumentsText:
    index: int
    text: str


Event = ContentText | CallStart | ArgumentsText


class ToolCallParser:
    """The events of one choice's text: `feed` each piece as it arrives, then `finish` once."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.num_calls = 0
        self._held_whitespace = ""

    def feed(self, text: str) -> list[Event]:
        for ch in text:
            self._feed_char(ch)
        self._end_of_piece()
        return self._take()

    def finish(self) -> list[Event]:
        self._end_of_text()
        if self._held_whitespace and not self.num_calls:
            self.events.append(ContentText(self._held_whitespace))
        return self._take()

    # -- what each parser defines -------------------------------------------------------------------

    def _feed_char(self, ch: str) -> None:
        raise NotImplementedError

    def _end_of_piece(self) -> None:
        """Emit what the text so far makes certain (the end of one streamed piece)."""

    def _end_of_text(self) -> None:
        raise NotImplementedError

    # -- for the parsers --------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if not text:
            return
        text = self._held_whitespace + text
        kept = text.rstrip(WHITESPACE)
        self._held_whitespace = text[len(kept):]
        if kept:
            self._merge(ContentText(kept))

    def _merge(self, event: Event) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(event, ContentText) and isinstance(last, ContentText):
            last.text += event.text
        elif isinstance(event, ArgumentsText) and isinstance(last, ArgumentsText) and last.index == event.index:
            last.text += event.text
        else:
            self.events.append(event)

    def _take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class _Call:
    """One call object being read: its name once known, its argument text, and the raw text (to give back as
    content if it turns out not to be a call before its name is known)."""

    def __init__(self, parser: ToolCallParser, arguments_keys: tuple[str, ...]) -> None:
        self.parser = parser
        self.index = parser.num_calls
        self.scanner = CallObjectScanner(arguments_keys)
        self.raw = ""
        self.started = False  # CallStart was emitted
        self.pending_arguments = ""  # arguments that came before the name

    def feed(self, ch: str) -> None:
        """Raises ValueError where the text is not a call."""
        self.raw += ch
        piece = self.scanner.feed(ch)
        if not self.started:
            self.pending_arguments += piece
            if self.scanner.name is not None:
                self.started = True
                self.parser.num_calls += 1
                self.parser._merge(CallStart(self.index, self.scanner.name))
                self._arguments(self.pending_arguments)
        else:
            self._arguments(piece)
        if self.scanner.done:
            if not self.started:
                raise ValueError("a tool call without a name")
            if not self.scanner.arguments_started:
                self._arguments("{}")  # a call of a function without parameters

    def _arguments(self, text: str) -> None:
        if text:
            self.parser._merge(ArgumentsText(self.index, text))


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among content (Hermes, Qwen2.5, Qwen3,
    SmolLM2), as many as the model writes."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.mode: Literal["content", "call", "after_call", "skip"] = "content"
        self.pending = ""  # content that may be the start of OPEN, or text after a call's object
        self.call: _Call | None = None

    def _feed_char(self, ch: str) -> None:
        if self.mode == "content":
            self.pending += ch
            if self.pending.endswith(self.OPEN):
                self._content(self.pending[:-len(self.OPEN)])
                self.pending = ""
                self.mode, self.call = "call", _Call(self, ("arguments",))
        elif self.mode == "call":
            self._feed_call(ch)
        else:  # after a call's object: its closing tag (or, if it never comes, more content)
            self.pending += ch
            if self.pending.endswith(self.CLOSE):
                self.mode, self.pending = "content", ""
            elif self.mode == "after_call" and not self.CLOSE.startswith(self.pending.lstrip(WHITESPACE)):
                self.mode = "content"

    def _feed_call(self, ch: str) -> None:
        call = self.call
        try:
            call.feed(ch)
        except ValueError:
            if call.started:
                self.mode, self.pending = "skip", ""
            else:  # not a call after all: its text is content
                self._content(self.OPEN + call.raw)
                self.mode = "content"
            return
        if call.scanner.done:
            self.mode, self.pending = "after_call", ""

    def _end_of_piece(self) -> None:
        if self.mode == "content":
            keep = next((k for k in range(len(self.OPEN) - 1, 0, -1) if self.pending.endswith(self.OPEN[:k])), 0)
            self._content(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]

    def _end_of_text(self) -> None:
        if self.mode == "content":
            self._content(self.pending)
        elif self.mode == "call" and not self.call.started:
            self._content(self.OPEN + self.call.raw)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1+'s JSON calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `;`; a reply that starts otherwise is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.mode: Literal["start", "between", "call", "content", "drop"] = "start"
        self.before = ""  # the text since the start or the last call: whitespace, the tag, `;`
        self.call: _Call | None = None

    def _feed_char(self, ch: str) -> None:
        if self.mode == "content":
            self._content(ch)
        elif self.mode == "call":
            self._feed_call(ch)
        elif self.mode != "drop":
            self.before += ch
            head = self.before.lstrip(WHITESPACE + ";")
            if self.mode == "start" and head.startswith(self.PYTHON_TAG):
                head = head[len(self.PYTHON_TAG):].lstrip(WHITESPACE)
            elif self.mode == "start" and self.PYTHON_TAG.startswith(head):
                return  # the tag, perhaps
            if not head:
                return
            if head == "{":
                self.before = self.before[:-1]
                self.mode, self.call = "call", _Call(self, ("parameters", "arguments"))
                self._feed_call(ch)
            else:
                self.mode = "content"
                self._content(self.before)

    def _feed_call(self, ch: str) -> None:
        try:
            self.call.feed(ch)
        except ValueError:
            if self.call.started:
                self.mode = "drop"
            else:  # not a call after all: its text is content
                self.mode = "content"
                self._content(self.before + self.call.raw)
            return
        if self.call.scanner.done:
            self.mode, self.before = "between", ""

    def _end_of_text(self) -> None:
        if self.mode == "start" or (self.mode == "between" and not self.num_calls):
            self._content(self.before)
        elif self.mode == "call" and not self.call.started:
            self._content(self.before + self.call.raw)


class RequiredCallsParser(ToolCallParser):
    """What `tool_choice: "required"` is constrained to (app/tool_calls/plan.py): a JSON array of
    `{"name": ..., "arguments": {...}}` objects."""

    def __init__(self) -> None:
        super().__init__()
        self.mode: Literal["start", "element_or_end", "call", "after", "element", "done", "failed"] = "start"
        self.raw = ""
        self.call: _Call | None = None

    def _feed_char(self, ch: str) -> None:
        self.raw += ch
        if self.mode in ("done", "failed"):
            return
        if self.mode == "call":
            try:
                self.call.feed(ch)
            except ValueError:
                self.mode = "failed"
                return
            if self.call.scanner.done:
                self.mode = "after"
            return
        if ch in WHITESPACE:
            return
        if self.mode == "start" and ch == "[":
            self.mode = "element_or_end"
        elif self.mode in ("element_or_end", "element") and ch == "{":
            self.mode, self.call = "call", _Call(self, ("arguments",))
            self.call.feed(ch)
        elif self.mode in ("element_or_end", "after") and ch == "]":
            self.mode = "done"
        elif self.mode == "after" and ch == ",":
            self.mode = "element"
        else:
            self.mode = "failed"

    def _end_of_text(self) -> None:
        if not self.num_calls:  # not the constrained JSON (the grammar did not hold, or was cut short)
            self._content(self.raw)


class NamedCallParser(ToolCallParser):
    """What a named `tool_choice` is constrained to: the text is that function's arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.value = JsonValueScanner()

    def _feed_char(self, ch: str) -> None:
        if not self.num_calls:
            self.num_calls = 1
            self._merge(CallStart(0, self.name))
        if self.value.done or (not self.value.started and ch in WHITESPACE):
            return
        try:
            if self.value.feed(ch):
                self._merge(ArgumentsText(0, ch))
        except ValueError:
            self.value.done = True  # the rest is not the arguments

    def _end_of_text(self) -> None:
        if not self.num_calls:
            self.num_calls = 1
            self._merge(CallStart(0, self.name))


AUTO_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
