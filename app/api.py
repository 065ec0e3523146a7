"""FastAPI routes of the OpenAI-compatible API, with OpenAI's error shape for every failure a client can cause."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator
from contextlib import aclosing
from importlib import metadata
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.auth import api_key_matches
from app.errors import (
    RETRY_AFTER_S,
    AuthenticationError,
    BodyTooLargeError,
    EngineOverloadedError,
    ModelNotFoundError,
    engine_dead_error,
    error_response,
)
from app.openapi import (
    CHAT_COMPLETIONS_ROUTE,
    COMPLETIONS_ROUTE,
    DETOKENIZE_ROUTE,
    HEALTH_ROUTE,
    TOKENIZE_ROUTE,
    VersionInfo,
    error_responses,
    install_openapi,
)
from app.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelList
from app.serving import OpenAIServing
from app.tokenization import DetokenizeRequest, detokenize, tokenize, tokenize_request_model
from engine.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger("shardserve.api")

RequestModel = TypeVar("RequestModel", bound=BaseModel)


def _version() -> str:
    try:
        return metadata.version("shardserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


async def read_json_body(request: Request, limit: int) -> object:
    """The parsed JSON body; 413 past `limit` bytes (checked while reading), 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"The request body is {declared} bytes; the limit is {limit} bytes.")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise BodyTooLargeError(f"The request body is over the limit of {limit} bytes.")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"We could not parse the JSON body of your request: {e}", param=None) from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise InvalidRequestError("We could not parse the JSON body of your request: it is nested too deeply.",
                                  param=None) from None


def parse_request(model: type[RequestModel], body: object) -> RequestModel:
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidRequestError(f"{loc}: {first['msg']} (got {first.get('input')!r})"[:500],
                                  param=str(first["loc"][0]) if first["loc"] else None) from None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        return error_response(400, e.message, "invalid_request_error", param=e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        return error_response(400, str(e.errors()[:1]), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):  # unknown path or method
        message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        return error_response(e.status_code, message, "invalid_request_error", headers=e.headers)

    @app.exception_handler(ModelNotFoundError)
    async def _not_found(_: Request, e: ModelNotFoundError):
        return error_response(404, str(e), "NotFoundError", param="model", code="model_not_found")

    @app.exception_handler(AuthenticationError)
    async def _unauthorized(_: Request, e: AuthenticationError):
        return error_response(401, str(e), "invalid_request_error", code="invalid_api_key")

    @app.exception_handler(BodyTooLargeError)
    async def _too_large(_: Request, e: BodyTooLargeError):
        return error_response(413, str(e), "invalid_request_error", code="request_too_large")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, e: EngineOverloadedError):
        return error_response(429, str(e), "rate_limit_error", code="server_overloaded",
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        # Serve replaces this replica after its health check fails; a retry may reach another one
        return JSONResponse(ErrorResponse(error=engine_dead_error(e)).model_dump(), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}", "InternalServerError")


def build_api(serving: OpenAIServing, stream_batching: StreamBatching, api_key: str | None = None,
              max_request_body_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    """The routes of one replica's HTTP app: OpenAI's over `serving`, plus /health, /version and engine stats.

    app/deployment.py build_replica_app adds the rest of a replica's app around it (call that one).
    stream_batching: how streamed responses are written (see StreamBatching)."""
    app = FastAPI(title="shardserve", version=_version(), docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    install_openapi(app, serving.served_model_name, bearer_auth=api_key is not None)
    engine = serving.engine

    async def require_api_key(request: Request) -> None:
        if api_key is not None and not api_key_matches(request.headers.get("authorization", ""), api_key):
            raise AuthenticationError("Incorrect API key provided: send `Authorization: Bearer <key>`.")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=error_responses(401))
    # vLLM's tokenizer routes sit at the root, behind the same key
    tokens = APIRouter(dependencies=[Depends(require_api_key)], responses=error_responses(401))

    @app.get("/health", **HEALTH_ROUTE)
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine loop is not running"}, status_code=503)

    @app.get("/version", response_model=VersionInfo)
    async def version() -> dict:
        return {"version": _version()}

    @v1.get("/models", responses={200: {"model": ModelList}})
    async def models() -> Response:
        return Response(serving.models().model_dump_json(), media_type="application/json")

    @v1.get("/engine/stats")
    async def engine_stats() -> dict:
        return engine_stats_dict(engine)

    @v1.post("/completions", **COMPLETIONS_ROUTE)
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_json_body(request, max_request_body_bytes))
        return _respond(await serving.create_completion(body), stream_batching)

    @v1.post("/chat/completions", **CHAT_COMPLETIONS_ROUTE)
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_json_body(request, max_request_body_bytes))
        return _respond(await serving.create_chat_completion(body), stream_batching)

    @tokens.post("/tokenize", **TOKENIZE_ROUTE)
    async def tokenize_route(request: Request) -> Response:
        body = await read_json_body(request, max_request_body_bytes)
        return _respond(tokenize(serving, parse_request(tokenize_request_model(body), body)), stream_batching)

    @tokens.post("/detokenize", **DETOKENIZE_ROUTE)
    async def detokenize_route(request: Request) -> Response:
        body = parse_request(DetokenizeRequest, await read_json_body(request, max_request_body_bytes))
        return _respond(detokenize(serving, body), stream_batching)

    app.include_router(v1)
    app.include_router(tokens)
    return app


def engine_stats_dict(engine) -> dict:
    stats = engine.stats()
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    if isinstance(stats, BaseModel):
        return stats.model_dump()
    return dict(vars(stats))


def _respond(result, batching: StreamBatching) -> Response:
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    if batching.interval_s > 0 or batching.max_writes_per_s > 0:
        result = coalesce_stream(result, batching)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@dataclasses.dataclass
class StreamBatching:
    """How often a replica writes its streamed responses (what Ray Serve LLM calls stream batching).

    Behind Ray Serve every write is a message from the replica through the proxy, and on a CPU host
    those processes share the cores with the engine: at 50 concurrent streams, a write per token cost
    about a third of the served throughput on 2 cores (docs/BENCHMARKS.md). So a stream writes at most
    once per `interval()`, joining the events that came in between: `interval_s`, stretched so that
    all the replica's streams together make at most `max_writes_per_s` writes a second (0: no cap).
    """

    interval_s: float = 0.05
    max_writes_per_s: float = 0.0
    active: int = 0  # streams open now

    def interval(self) -> float:
        if self.max_writes_per_s > 0:
            return max(self.interval_s, self.active / self.max_writes_per_s)
        return self.interval_s


async def coalesce_stream(events: AsyncIterator[str], batching: StreamBatching) -> AsyncIterator[str]:
    """SSE events joined into fewer writes: the first at once (TTFT is untouched), then at most one
    write per `batching.interval()`, carrying every event that arrived meanwhile; the rest when the
    stream ends. Every event stays its own `data:` line, so clients see the same events; an event
    waits at most until the next one arrives (one engine step) or the stream ends.
    """
    loop = asyncio.get_running_loop()
    pending: list[str] = []
    last_write = -math.inf
    batching.active += 1
    try:
        async with aclosing(events):
            async for event in events:
                pending.append(event)
                now = loop.time()
                if now - last_write >= batching.interval():
                    yield "".join(pending)
                    pending.clear()
                    last_write = now
        if pending:
            yield "".join(pending)
    finally:
        batching.active -= 1
