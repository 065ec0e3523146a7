"""Request fields whose meaning is known (OpenAI's, vLLM's) but that shardserve does not implement: each is a 400
naming it, unless its value changes nothing. Nothing a client sends to change the output is dropped silently.

Unknown fields are still ignored (as OpenAI ignores them), and fields that do not change the output are
accepted (`user`, `metadata`, `store`, `service_tier`, ...). docs/OPERATIONS.md lists both sets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class Unsupported:
    name: str
    changes_nothing: Callable[[object, dict], bool]  # (value, body): values that leave the output as it is
    instead: str  # what to send instead, or why not


def _unset(value, body) -> bool:
    return value is None


def _unset_or_false(value, body) -> bool:
    return value is None or value is False


def _unset_or_true(value, body) -> bool:
    return value is None or value is True


def _unset_or_empty(value, body) -> bool:
    return value is None or value == [] or value == {}


def _best_of_is_n(value, body) -> bool:
    return value is None or value == 1 or value == body.get("n", 1)


BOTH = (
    Unsupported("best_of", _best_of_is_n, "ask for `n` choices instead"),
    Unsupported("use_beam_search", _unset_or_false, "beam search is not implemented"),
    Unsupported("length_penalty", lambda v, b: v is None or v == 1, "it applies to beam search only"),
    Unsupported("prompt_logprobs", _unset, "prompt logprobs are not implemented"),
    Unsupported("allowed_token_ids", _unset, "use `logit_bias` or a structured output instead"),
    Unsupported("bad_words", _unset_or_empty, "use `logit_bias` instead"),
    Unsupported("truncate_prompt_tokens", _unset, "shorten the prompt instead"),
    Unsupported("include_stop_str_in_output", _unset_or_false, "stop strings are always left out"),
    Unsupported("spaces_between_special_tokens", _unset_or_true, "text is decoded as the tokenizer joins it"),
    Unsupported("guided_whitespace_pattern", _unset, "use `structured_outputs.disable_any_whitespace`"),
    Unsupported("return_tokens_as_token_ids", _unset_or_false, "tokens are returned as text"),
    Unsupported("prompt_embeds", _unset, "send text or token ids"),
)
COMPLETIONS = (
    *BOTH,
    Unsupported("add_special_tokens", _unset_or_true, "the prompt is always tokenized with special tokens"),
)
CHAT = (
    *BOTH,
    Unsupported("functions", _unset, "send `tools` (the legacy `functions` is not implemented)"),
    Unsupported("function_call", _unset, "send `tool_choice` (the legacy `function_call` is not implemented)"),
    Unsupported("audio", _unset, "this server generates text only"),
    Unsupported("modalities", lambda v, b: v is None or v == ["text"], "this server generates text only"),
    Unsupported("prediction", _unset, "predicted outputs are not implemented"),
    Unsupported("web_search_options", _unset, "this server does not search the web"),
    Unsupported("reasoning_effort", _unset, "the served model takes no reasoning effort"),
    Unsupported("verbosity", _unset, "the served model takes no verbosity"),
    Unsupported("echo", _unset_or_false, "the prompt is not echoed in chat"),
    Unsupported("add_generation_prompt", _unset_or_true, "the assistant's turn is always opened"),
    Unsupported("continue_final_message", _unset_or_false, "the assistant's turn is always a new one"),
    Unsupported("add_special_tokens", _unset_or_false, "the chat template adds the special tokens"),
    Unsupported("chat_template", _unset, "start the server with --chat-template instead"),
    Unsupported("chat_template_kwargs", _unset_or_empty, "the template gets messages and tools only"),
    Unsupported("documents", _unset, "put the documents in the messages"),
    Unsupported("mm_processor_kwargs", _unset, "this server serves text-only models"),
)


def refuse_unsupported_fields(body: object, fields: tuple[Unsupported, ...]) -> None:
    """Raise InvalidRequestError (400) naming the first field of `fields` whose value in `body` would change
    the output."""
    if not isinstance(body, dict):
        return
    for field in fields:
        if field.name in body and not field.changes_nothing(body[field.name], body):
            raise InvalidRequestError(f"`{field.name}` is not supported by this server: {field.instead}.",
                                      param=field.name)


def refuse_non_text_parts(message: object, index: int) -> None:
    """Raise InvalidRequestError for a message content part other than text (image, audio, file)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise InvalidRequestError(
                f"messages[{index}] has a `{kind}` content part: this server serves a text-only model; send "
                "text parts only.", param="messages")
