"""The token ids of an OpenAI request's prompts: what a replica's engine runs and what the ingress routes by.

One rendering for both, so that the block hashes the ingress routes by (app/routing/block_hashes.py) are the
ones the replica's prefix cache names the same prompt's blocks by.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.protocol import ChatCompletionRequest, CompletionRequest
from app.tool_calls.rendering import template_inputs
from engine.detokenizer import rust_encode
from engine.errors import InvalidRequestError


@dataclass
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


def completion_prompts(tokenizer, req: CompletionRequest) -> list[Prompt]:
    """A completion request's prompts: a string, a list of token ids, or a list of either."""
    raw = req.prompt
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise InvalidRequestError("The prompt is empty: send at least one prompt.", param="prompt")
    encode = rust_encode(tokenizer)
    return [Prompt(item, encode(item)) if isinstance(item, str) else Prompt(None, list(item)) for item in items]


def chat_prompt(tokenizer, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> Prompt:
    """A chat's messages (and tools) through the model's chat template, with the assistant's turn opened
    (unless `add_generation_prompt` is false: POST /tokenize may ask for the messages alone)."""
    messages, tools = template_inputs(tokenizer, req.messages, req.tools)  # app/tool_calls/rendering.py
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **({"tools": tools} if tools else {}))
    except Exception as e:  # jinja errors: the template rejected these messages
        raise InvalidRequestError(f"The chat template cannot render these messages: {e}",
                                  param="messages") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return Prompt(None, list(ids))
