"""What a chat request's `tools` and `tool_choice` ask of its output: the JSON schema that `required` and a
named function decode under (so the arguments always validate against the function's `parameters`), and the
parser that reads the calls back from each choice's text.

- `none` (or no tools): plain content; the tools are still shown to the model, as vLLM does.
- `auto` (the default with tools): not constrained; the server's --tool-call-parser reads the calls the model
  chose to write. Only with --enable-auto-tool-choice, else 400, as at vLLM.
- `required`: a JSON array of 1+ (exactly 1 with `parallel_tool_calls: false`) `{"name", "arguments"}` objects,
  each name one of the tools and its arguments that tool's `parameters`.
- a named function: the output is that function's arguments object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from app.tool_calls.parsers import AUTO_PARSERS, NamedCallParser, RequiredCallsParser, ToolCallParser
from app.tool_calls.protocol import ChatTool, FunctionDefinition, NamedToolChoice, ToolChoice
from app.tool_calls.streaming import ChoiceToolCalls
from engine.errors import InvalidRequestError

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a function without `parameters` takes none


@dataclass(frozen=True)
class ToolCallPlan:
    mode: Literal["auto", "required", "named"]
    schema: dict | None  # what the output is constrained to (structured_outputs.json); None for auto
    new_parser: Callable[[], ToolCallParser]
    max_calls: int | None  # 1 with parallel_tool_calls false

    def choice_calls(self) -> ChoiceToolCalls:
        """A fresh reader of one choice's calls."""
        return ChoiceToolCalls(self.new_parser(), self.max_calls)


def plan_tool_calls(tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None,
                    enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolCallPlan | None:
    """The plan of a request's tool calls, or None where its output is plain content. Raises
    InvalidRequestError (400) for a choice the server cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools: send the functions the model may call in `tools`.",
                                      param="tool_choice")
        return None
    functions = _functions_by_name(tools)
    parallel = parallel_tool_calls is not False
    max_calls = None if parallel else 1
    choice = tool_choice or "auto"  # OpenAI's default when tools are sent
    if choice == "none":
        return None
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise InvalidRequestError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolCallPlan("auto", None, AUTO_PARSERS[tool_call_parser], max_calls)
    if choice == "required":
        return ToolCallPlan("required", required_schema(list(functions.values()), parallel), RequiredCallsParser,
                            max_calls)
    assert isinstance(choice, NamedToolChoice)
    function = functions.get(choice.function.name)
    if function is None:
        raise InvalidRequestError(
            f"tool_choice names the function `{choice.function.name}`, which is not in tools "
            f"({', '.join(f'`{name}`' for name in functions)}).", param="tool_choice")
    return ToolCallPlan("named", arguments_schema(function), lambda: NamedCallParser(function.name), 1)


def _functions_by_name(tools: list[ChatTool]) -> dict[str, FunctionDefinition]:
    functions: dict[str, FunctionDefinition] = {}
    for tool in tools:
        if tool.function.name in functions:
            raise InvalidRequestError(f"tools holds two functions named `{tool.function.name}`.", param="tools")
        functions[tool.function.name] = tool.function
    return functions


def arguments_schema(function: FunctionDefinition) -> dict:
    return function.parameters if function.parameters is not None else NO_PARAMETERS


def required_schema(functions: list[FunctionDefinition], parallel: bool) -> dict:
    """An array of calls, each `{"name": <a tool's name>, "arguments": <that tool's parameters>}`. Each tool's
    `$defs` move to the root (renamed per tool), where its `$ref`s then point."""
    definitions: dict = {}
    calls = []
    for i, function in enumerate(functions):
        arguments = _hoist_definitions(arguments_schema(function), f"tool{i}_", definitions)
        calls.append({"type": "object", "properties": {"name": {"const": function.name}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _hoist_definitions(schema: dict, prefix: str, definitions: dict) -> dict:
    """`schema` without its `$defs`/`definitions`, which go into `definitions` under `prefix`+name, with every
    local reference to them renamed."""
    schema = copy.deepcopy(schema)
    renamed = {}
    for key in ("$defs", "definitions"):
        for name, definition in (schema.pop(key, None) or {}).items():
            renamed[f"#/{key}/{name}"] = f"#/$defs/{prefix}{name}"
            definitions[f"{prefix}{name}"] = definition

    def rename(node):
        if isinstance(node, dict):
            return {k: renamed.get(v, v) if k == "$ref" and isinstance(v, str) else rename(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rename(v) for v in node]
        return node

    if not renamed:
        return schema
    for name in list(definitions):
        if name.startswith(prefix):
            definitions[name] = rename(definitions[name])
    return rename(schema)
