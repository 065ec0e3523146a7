"""The errors the app itself raises, and OpenAI's error body that every failure a client sees is sent in.

app/api.py maps these and the engine's errors (engine/errors.py) to HTTP status codes; app/drain.py and
app/proxy_errors.py answer in the same shape with the same Retry-After.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.responses import JSONResponse

from app.protocol import ErrorInfo, ErrorResponse

if TYPE_CHECKING:
    from engine.errors import EngineDeadError

# what 429 and 503 answers tell clients to wait: a replica's waiting queue drains in about a second at tested
# loads, and Serve replaces a dead replica within seconds (a retry may reach another one sooner)
RETRY_AFTER_S = 1


class ModelNotFoundError(Exception):
    """The request names a model this server does not serve: maps to HTTP 404."""


class EngineOverloadedError(Exception):
    """The replica's engine already has `max_waiting_requests` waiting: maps to HTTP 429 with Retry-After."""


class BodyTooLargeError(Exception):
    """The request body is over `max_request_body_bytes`: maps to HTTP 413."""


class AuthenticationError(Exception):
    """Missing or wrong `Authorization: Bearer` key: maps to HTTP 401."""


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def engine_dead_error(e: EngineDeadError) -> ErrorInfo:
    """What a client is told when the engine has died: as a 503's body, or as a stream's last event."""
    return ErrorInfo(message=f"The engine has stopped: {e}", type="service_unavailable_error", code="engine_dead")
