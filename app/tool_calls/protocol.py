"""OpenAI's tool-calling shapes: the `tools` and `tool_choice` a chat request sends, the `tool_calls` of an
assistant message (in the history sent, and in a response), and their streamed fragments."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# a request's parts are strict (app/protocol.py): `"strict": 1` is refused, as OpenAI refuses it
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; left out: no arguments
    strict: bool | None = None  # always enforced where the call is constrained (tool_choice required or named)


class ChatTool(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = REQUEST_CONFIG

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = REQUEST_CONFIG

    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    model_config = REQUEST_CONFIG

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):  # a fragment carries only what it adds
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A fragment of a streamed call: the first has id, type, name and arguments "", the rest argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}
