"""A chat's tools and tool turns as the chat template's inputs (app/prompts.py renders them).

A template that renders tools (its source mentions `tools`, as Qwen2.5's, Qwen3's and Llama 3.1's do) gets
them as transformers passes them: `apply_chat_template(messages, tools=[...])`, an assistant turn's
`tool_calls` with the arguments as objects, a tool turn with its `tool_call_id` (and `name`).

A template that cannot (the demo model's, SmolLM2's) gets the default rendering, Hermes-style, in plain
messages: a system block listing the functions as JSON and the `<tool_call>` format to call them in; an
assistant turn's calls as `<tool_call>` blocks after its text; tool turns as `<tool_response>` blocks in a
user turn (consecutive ones together). The hermes --tool-call-parser reads that format back.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from app.tool_calls.protocol import ChatTool, ToolCall
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from app.protocol import ChatMessage

DEFAULT_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template can show tools (a template that never mentions them cannot)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks `tool_use` when tools are passed
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def template_inputs(tokenizer, messages: list[ChatMessage],
                    tools: list[ChatTool] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to pass to `apply_chat_template` (tools None: pass none)."""
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    has_tool_turns = any(m.tool_calls or m.role == "tool" for m in messages)
    if not (tool_dicts or has_tool_turns):
        return [{"role": m.role, "content": m.text()} for m in messages], None
    if renders_tools(tokenizer):
        return [_template_message(i, m) for i, m in enumerate(messages)], tool_dicts
    return default_rendering(messages, tool_dicts), None


def _template_message(i: int, message: ChatMessage) -> dict:
    rendered: dict = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(i, j, call)}}
            for j, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        rendered |= {k: v for k, v in (("tool_call_id", message.tool_call_id), ("name", message.name)) if v}
    return rendered


def _arguments(i: int, j: int, call: ToolCall) -> object:
    """A call's arguments as the object they encode (transformers' templates write them with `tojson`)."""
    try:
        return json.loads(call.function.arguments)
    except ValueError as e:
        raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}",
                                  param="messages") from None


def default_rendering(messages: list[ChatMessage], tools: list[dict] | None) -> list[dict]:
    """The Hermes-style rendering for a template that cannot show tools (see the module docstring)."""
    rendered: list[dict] = []
    responses_at = None  # the user turn that the latest tool responses went into
    for i, message in enumerate(messages):
        if message.role == "tool":
            response = f"<tool_response>\n{message.text()}\n</tool_response>"
            if responses_at == len(rendered) - 1:
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
                responses_at = len(rendered) - 1
            continue
        content = message.text()
        if message.tool_calls:
            blocks = [json.dumps({"name": call.function.name, "arguments": _arguments(i, j, call)}, ensure_ascii=False)
                      for j, call in enumerate(message.tool_calls)]
            content = "\n".join(([content] if content else []) + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
        rendered.append({"role": message.role, "content": content})
    if tools:
        block = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{block}" if rendered[0]["content"] else block
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered
