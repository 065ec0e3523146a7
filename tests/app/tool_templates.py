"""A chat template that renders tools, in the shape of Qwen2.5's (ChatML turns, the tools as JSON in the system
turn, calls as `<tool_call>` blocks, tool results as `<tool_response>` blocks in a user turn), written with the
tiny models' `<s>` / `</s>` for `<|im_start|>` / `<|im_end|>` so that a turn still ends at their EOS."""

from __future__ import annotations

QWEN2_STYLE_TOOLS_TEMPLATE = (
    # no newline right after a `%}`: transformers renders with trim_blocks, which would drop it
    "{% if tools %}"
    "<s>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call></s>\n'
    "{% elif messages[0].role == 'system' %}"
    "<s>system\n{{ messages[0].content }}</s>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<s>assistant\n{% if message.content %}{{ message.content + '\\n' }}{% endif %}"
    "{% for call in message.tool_calls %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}</s>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<s>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}</s>{{ '\\n' }}{% endif %}"
    "{% else %}"
    "<s>{{ message.role }}\n{{ message.content }}</s>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
