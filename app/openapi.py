"""The published API contract: what /openapi.json says about the routes of app/api.py.

app/api.py reads the generation bodies by hand (to bound their size while reading and to keep OpenAI's
400 messages), so FastAPI sees no body parameter. This module documents them anyway: the request
models as each route's `requestBody`, the JSON response and its `text/event-stream` form, and every
error status in OpenAI's shape. A client generator or a fuzzer (tests/app/test_api_contract.py runs
schemathesis) then sees the API that the server really has. There is no 422: a body that does not
validate is a 400, as at OpenAI.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from app.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

SCHEMA_REF = "#/components/schemas/{model}"
BEARER_SCHEME = "bearerAuth"
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # what --api-key guards

ERROR_DESCRIPTIONS = {
    400: "The request is invalid: a body that is not a JSON object, a field of the wrong type (types are "
         "strict: `\"echo\": 0` is refused) or out of range, a prompt that does not fit the model's context, "
         "an output constraint that does not compile or comes with another, a tool_choice the server cannot "
         "honour, or a known field that this server does not implement. `error.param` names the field.",
    401: "The `Authorization: Bearer <key>` header is missing or wrong (only when the server has --api-key).",
    404: "The request names a model that this server does not serve (`error.code` is `model_not_found`).",
    413: "The body is larger than the server's --max-request-body-bytes.",
    429: "Too many requests are waiting: a replica's engine queue (--max-waiting-requests) or Ray Serve's "
         "router queue is full. Retry after `Retry-After` seconds.",
    503: "The engine has stopped, the server is shutting down (`error.code` is `server_shutting_down`), or no "
         "replica can take the request now. Retry after `Retry-After` seconds.",
}
RETRY_AFTER_HEADER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}},
}


class HealthStatus(BaseModel):
    """The body of GET /health."""

    status: str


class VersionInfo(BaseModel):
    """The body of GET /version."""

    version: str


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses, each with OpenAI's error body."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status],
                 **({"headers": RETRY_AFTER_HEADER} if status in (429, 503) else {})}
        for status in statuses
    }


def sse_event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One event of a stream (Open API 3.2's `itemSchema`; before 3.2, tools read `schema` as one event):
    its `data` is a chunk or an in-band error as JSON, or `[DONE]` at the end."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [{"$ref": SCHEMA_REF.format(model=chunk.__name__)},
                                         {"$ref": SCHEMA_REF.format(model=ErrorResponse.__name__)}]}},
        ]}},
    }


def generation_route(request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """Route-decorator arguments for a generation endpoint whose body app/api.py reads by hand."""
    return {
        "openapi_extra": {"requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": SCHEMA_REF.format(model=request.__name__)}}},
        }},
        "responses": {
            200: {
                "model": response,
                "description": (
                    f"A `{response.__name__}`; with `stream: true`, Server-Sent Events instead: each event is "
                    f"`data: <{chunk.__name__} JSON>` and the stream ends with `data: [DONE]`. An error after "
                    "the stream has started comes in-band as `data: <ErrorResponse JSON>`, then `[DONE]`."
                ),
                "content": {"text/event-stream": {"schema": sse_event_schema(chunk)}},
            },
            **error_responses(400, 401, 404, 413, 429, 503),
        },
    }


def json_route(requests: tuple[type[BaseModel], ...], response: type[BaseModel], description: str) -> dict[str, Any]:
    """Route-decorator arguments for a JSON endpoint whose body, one of `requests`, app/api.py reads by hand."""
    refs = [{"$ref": SCHEMA_REF.format(model=request.__name__)} for request in requests]
    return {
        "openapi_extra": {"requestBody": {
            "required": True, "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}},
        }},
        "responses": {200: {"model": response, "description": description}, **error_responses(400, 401, 404, 413)},
    }


HEALTH_ROUTE = {"responses": {
    200: {"model": HealthStatus, "description": "The engine loop runs."},
    503: {"model": HealthStatus, "description": "The engine loop has stopped."},
}}
COMPLETIONS_ROUTE = generation_route(CompletionRequest, CompletionResponse, CompletionResponse)
CHAT_COMPLETIONS_ROUTE = generation_route(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk)
TOKENIZE_ROUTE = json_route((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse, (
    "vLLM's /tokenize: the token ids of a `prompt` as /v1/completions encodes it, or of `messages` through the "
    "chat template as /v1/chat/completions renders them; `max_model_len` is the context they must fit in."))
DETOKENIZE_ROUTE = json_route((DetokenizeRequest,), DetokenizeResponse, (
    "vLLM's /detokenize: the text of token ids (each in the model's vocabulary, else a 400)."))


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
GREETING_SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 40},
                                                    "polite": {"type": "boolean"}},
                   "required": ["greeting", "polite"], "additionalProperties": False}


def request_examples(served_model: str) -> dict[str, dict[str, Any]]:
    """Ready-to-send bodies for each generation route, plain and streamed, naming the served model."""
    bodies = {
        "/v1/completions": {"model": served_model, "prompt": "Once upon a time", "max_tokens": 16},
        "/v1/chat/completions": {"model": served_model, "messages": [{"role": "user", "content": "Hello!"}],
                                 "max_tokens": 16},
    }
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    examples = {path: {"plain": {"summary": "One JSON response", "value": body},
                       "stream": {"summary": "Server-Sent Events, usage in the last chunk", "value": body | streamed}}
                for path, body in bodies.items()}
    chat = bodies["/v1/chat/completions"]
    examples["/v1/chat/completions"] |= {
        "tool_call": {"summary": "A call of the one tool, its arguments decoded under its parameters",
                      "value": chat | {"messages": [{"role": "user", "content": "The weather in Paris?"}],
                                       "max_tokens": 64, "tools": [WEATHER_TOOL], "tool_choice": "required"}},
        "json_schema": {"summary": "A reply that is a JSON document of the given schema",
                        "value": chat | {"max_tokens": 64, "response_format": {"type": "json_schema", "json_schema": {
                            "name": "greeting", "strict": True, "schema": GREETING_SCHEMA}}}},
    }
    return examples


def install_openapi(app: FastAPI, served_model: str, bearer_auth: bool) -> None:
    """Serve an /openapi.json that also holds the hand-read request bodies (with examples for
    `served_model`), the stream chunk models and, with an API key, the bearer scheme of the routes it guards."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="An OpenAI-compatible LLM server.")
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            requests = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                        DetokenizeRequest)
            for mode, models in (("validation", requests),
                                 ("serialization", (ChatCompletionChunk,))):
                _, defs = models_json_schema([(m, mode) for m in models], ref_template=SCHEMA_REF)
                for name, definition in defs.get("$defs", {}).items():
                    schemas.setdefault(name, definition)
            for path, examples in request_examples(served_model).items():
                schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["examples"] = examples
            if bearer_auth:
                components["securitySchemes"] = {BEARER_SCHEME: {"type": "http", "scheme": "bearer"}}
                for path, item in schema["paths"].items():
                    if path.startswith(KEYED_PATHS):
                        for operation in item.values():
                            operation["security"] = [{BEARER_SCHEME: []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
