"""The wire format that the replica, the ingress and Serve's proxy middleware share: Server-Sent Events, the
in-band error that ends a stream whose response has started, and header lookup in raw ASGI header lists.

A stream is `data: <JSON>` events, each ended by a blank line, and its last event is `data: [DONE]` (OpenAI's
framing). Once the status line has gone out, an error can only be told in-band: an ErrorResponse event, then
[DONE]. The replica ends a stream so when its engine fails; the ingress and the proxy middleware do when the
replica itself goes away mid-stream (`replica_lost_ending`).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Message

from app.protocol import ErrorInfo, ErrorResponse

EVENT_STREAM = b"text/event-stream"
REPLICA_LOST = "The replica serving this request stopped before it finished; retry."


def sse(payload: str) -> str:
    """One event whose data is `payload`."""
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(info: ErrorInfo) -> str:
    """The in-band error event of a stream that failed after its response started."""
    return sse(ErrorResponse(error=info).model_dump_json())


def replica_lost_error() -> ErrorInfo:
    """What a request whose replica went away is told: the body of its 503, or its stream's error event."""
    return ErrorInfo(message=REPLICA_LOST, type="service_unavailable_error", code="replica_lost")


def replica_lost_ending() -> bytes:
    """The rest of a stream whose replica went away mid-response: the error event, then [DONE]."""
    return (sse_error(replica_lost_error()) + SSE_DONE).encode()


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes:
    """The value of header `name` (lower case) in a raw ASGI header list; b"" when it is absent."""
    return next((bytes(v) for k, v in headers if bytes(k).lower() == name), b"")


def is_event_stream(start: Message) -> bool:
    """Whether an `http.response.start` message begins a stream of events."""
    return header(start.get("headers", ()), b"content-type").startswith(EVENT_STREAM)
