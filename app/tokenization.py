"""POST /tokenize and /detokenize, in vLLM's shape: the token ids that the served model sees for a prompt, or for
chat messages through its chat template (the very rendering of /v1/chat/completions, app/prompts.py), and the
text of token ids. Routed in app/api.py, behind the same API key as /v1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from app.prompts import chat_prompt
from app.protocol import ChatCompletionRequest, ChatMessage
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from app.serving import OpenAIServing


class TokenizeCompletionRequest(BaseModel):
    """A prompt to tokenize as /v1/completions would."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS)")


class TokenizeChatRequest(BaseModel):
    """Chat messages to tokenize as /v1/chat/completions would."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="open the assistant's turn after the messages")
    add_special_tokens: bool = Field(False, description=(
        "add the tokenizer's special tokens on top of the chat template's: only false is supported"))


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request_model(body: object) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """Which form a /tokenize body has: messages make it a chat."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


def tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """The token ids of a prompt, or of chat messages rendered by the served chat template."""
    if req.model is not None:
        serving.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        if req.add_special_tokens:
            raise InvalidRequestError("add_special_tokens with messages is not supported: the chat template adds "
                                      "the model's special tokens.", param="add_special_tokens")
        chat = ChatCompletionRequest(model=serving.served_model_name, messages=req.messages)
        tokens = chat_prompt(serving.tokenizer, chat, add_generation_prompt=req.add_generation_prompt).token_ids
    else:
        tokens = list(serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return TokenizeResponse(count=len(tokens), max_model_len=serving.engine.max_model_len, tokens=tokens)


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids of the served model's vocabulary."""
    if req.model is not None:
        serving.check_model(req.model)
    vocab_size = serving.engine.model_config.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param="tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens))
