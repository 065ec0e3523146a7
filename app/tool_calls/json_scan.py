"""Char-by-char scanners for the JSON of a tool call, so that a streamed call's argument text can be sent as it
arrives and never taken back.

They track only what decides where a value ends (strings and their escapes, the nesting of objects and arrays,
where a number or literal stops) and refuse text that cannot be JSON there; what a value contains is checked by
whoever reads the finished call (the grammar, where the call was constrained).
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"
SCALAR_START = "-0123456789tfn"  # a number, true, false or null
SCALAR_CHARS = "+-.0123456789eEtruefalsn"
CLOSERS = {"{": "}", "[": "]"}


class JsonScanError(ValueError):
    """The text cannot be the JSON the scanner expects at this character."""


class JsonValueScanner:
    """Follows one JSON value (the caller skips the whitespace before it) to the character where it ends."""

    def __init__(self) -> None:
        self.open: list[str] = []  # the closers of the objects and arrays open now
        self.started = False
        self.done = False
        self.in_string = False
        self.escaped = False
        self.in_scalar = False

    def feed(self, ch: str) -> bool:
        """Whether `ch` is part of the value; False when the value ended just before it (a number or literal
        ends at the character after it). Raises JsonScanError where `ch` cannot follow."""
        if self.done:
            return False
        if not self.started:
            self.started = True
            return self._value_start(ch, top_level=True)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = not self.open
            return True
        if self.in_scalar:
            if ch in SCALAR_CHARS:
                return True
            self.in_scalar = False
            if not self.open:
                self.done = True
                return False
        if ch in WHITESPACE or ch in ",:":
            return True
        if ch in "}]":
            if ch != self.open[-1]:
                raise JsonScanError(f"{ch!r} does not close {self.open[-1]!r}")
            self.open.pop()
            self.done = not self.open
            return True
        return self._value_start(ch, top_level=False)

    def _value_start(self, ch: str, top_level: bool) -> bool:
        if ch == '"':
            self.in_string = True
        elif ch in CLOSERS:
            self.open.append(CLOSERS[ch])
        elif ch in SCALAR_START:
            self.in_scalar = True
        else:
            raise JsonScanError(f"{ch!r} cannot start a JSON value" + ("" if top_level else " here"))
        return True

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole value (a number at the end of the text is)."""
        return self.done or (self.in_scalar and not self.open)


class CallObjectScanner:
    """Follows one `{"name": "...", "arguments": {...}}` object from its `{`: reads the name, and hands back each
    character of the arguments value as it comes. `arguments_keys` are the keys that hold the arguments."""

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self.arguments_keys = arguments_keys
        self.state = "start"
        self.key_text = ""
        self.key = ""
        self.value: JsonValueScanner | None = None
        self.name_text = ""
        self.name: str | None = None
        self.arguments_started = False
        self.arguments_done = False
        self.done = False

    def feed(self, ch: str) -> str:
        """The part of `ch` that is argument text ("" or `ch`). Raises JsonScanError on text that is not a call."""
        if self.state == "value":
            if self.value.feed(ch):
                return self._value_char(ch)
            self._end_value()  # a number or literal ended at `ch`, which belongs to the object
        if self.state == "key":
            self.key_text += ch
            if ch == '"' and not _ends_in_escape(self.key_text[:-1]):
                self.key = json.loads('"' + self.key_text)
                self.state = "colon"
            return ""
        if ch in WHITESPACE:
            return ""
        expected = {"start": "{", "key_or_end": '"}', "key": '"', "next_key": '"', "colon": ":", "after": ",}"}
        if self.state == "value_start":
            self.value = JsonValueScanner()
            self.state = "value"
            return self.feed(ch)
        if ch not in expected[self.state]:
            raise JsonScanError(f"{ch!r} where a tool call's JSON expects one of {expected[self.state]!r}")
        if ch == "{":
            self.state = "key_or_end"
        elif ch == '"':
            self.key_text = ""
            self.state = "key"
        elif ch == ":":
            self.state = "value_start"
        elif ch == ",":
            self.state = "next_key"
        elif ch == "}":
            self.done = True
            self.state = "done"
        return ""

    def _value_char(self, ch: str) -> str:
        arguments = self.key in self.arguments_keys and not self.arguments_done
        if self.key == "name" and self.name is None:
            self.name_text += ch
        elif arguments:
            self.arguments_started = True
        if self.value.done:
            self._end_value()
        return ch if arguments else ""

    def _end_value(self) -> None:
        if self.key == "name" and self.name is None:
            name = json.loads(self.name_text)
            if not isinstance(name, str):
                raise JsonScanError(f"a tool call's name must be a string, got {self.name_text}")
            self.name = name
        elif self.key in self.arguments_keys:
            self.arguments_done = True
        self.state = "after"


def _ends_in_escape(text: str) -> bool:
    """Whether `text` ends in an odd number of backslashes (the next character is escaped)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1
