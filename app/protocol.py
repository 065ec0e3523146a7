"""OpenAI's request and response bodies (completions, chat completions, models, errors) as pydantic models.

Requests ignore unknown fields like OpenAI does, and refuse known ones that shardserve does not implement
(app/unsupported_fields.py). Their types are strict, as OpenAI's are: a value of the wrong type (`"echo": 0`,
`"n": true`) fails validation (a 400 in app/api.py); a float field still takes an integer.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from app.structured_outputs import ResponseFormat, StructuredOutputsRequest
from app.tool_calls.protocol import ChatTool, DeltaToolCall, ToolCall, ToolChoice
from app.unsupported_fields import CHAT, COMPLETIONS, refuse_non_text_parts, refuse_unsupported_fields

MAX_N = 128  # OpenAI's bound on `n`
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)
TOKEN_ID_KEY = r"^[0-9]{1,9}$"
# logit_bias: token ids (as JSON keys, so strings) -> a bias; a key that is not a token id is refused
LogitBias = Annotated[
    dict[Annotated[str, StringConstraints(pattern=TOKEN_ID_KEY)], float],
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": TOKEN_ID_KEY},
                    "additionalProperties": {"type": "number"}}),
]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields both endpoints share (OpenAI's plus vLLM's extras)."""

    model_config = REQUEST_CONFIG

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: LogitBias | None = Field(None, description=(
        "token id (as a string) -> bias in [-100, 100] added to its logit before sampling"))
    # constraints on the output (app/structured_outputs.py): at most one per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = Field(None, description=(
        "vLLM's constraint: exactly one of json (a JSON schema), json_object, regex, choice, grammar (EBNF), "
        "structural_tag"))
    guided_json: str | dict | None = Field(None, description="vLLM's older form of structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older form of structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM's older form of structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM's older form of structured_outputs.grammar")

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        refuse_unsupported_fields(data, COMPLETIONS)
        return data


class TextContentPart(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = Field(None, description=(
        "none, auto (the default with tools; needs the server's --enable-auto-tool-choice), required, or a named "
        "function; required and a named function are decoded under the functions' parameters"))
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default: several)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        refuse_unsupported_fields(data, CHAT)
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            for i, message in enumerate(data["messages"]):
                refuse_non_text_parts(message, i)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the replica's prefix cache already held


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


# -- /v1/completions ------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions -------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # None where the reply is only tool calls
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler):  # as OpenAI: a reply without calls has no `tool_calls` key
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):  # OpenAI leaves `role` out of every chunk but the first
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/models -----------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "shardserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
