"""One streaming POST to an ASGI app, write by write, with a client that can leave mid-stream.

httpx's ASGI transport returns a response only once the app has finished it, and its client cannot leave
early; a server (uvicorn, Serve's proxy) tells the app that the client left with an `http.disconnect` message,
which is what `leave()` sends.
"""

from __future__ import annotations

import asyncio
import json


class StreamingPost:
    """POST `body` as JSON to `path`; then `status()`, `next_write()` until None, or `leave()`."""

    def __init__(self, app, path: str, body: dict, headers: dict[str, str] | None = None):
        raw = json.dumps(body).encode()
        self._messages: asyncio.Queue[dict] = asyncio.Queue()
        self._left = asyncio.Event()
        self._body_sent = False
        self._ended = False
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"replica"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(raw)).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80),
        }

        async def receive() -> dict:
            if not self._body_sent:
                self._body_sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await self._left.wait()
            return {"type": "http.disconnect"}

        self._task = asyncio.create_task(app(scope, receive, self._messages.put))

    async def status(self) -> int:
        message = await self._messages.get()
        assert message["type"] == "http.response.start", message
        return message["status"]

    async def next_write(self) -> bytes | None:
        """The next non-empty write of the response body; None once the response has ended."""
        while not self._ended:
            message = await self._messages.get()
            self._ended = not message.get("more_body", False)
            if message.get("body"):
                return message["body"]
        await self._task
        return None

    async def writes(self) -> list[bytes]:
        """Every write from here to the end of the response."""
        out = []
        while (write := await self.next_write()) is not None:
            out.append(write)
        return out

    async def leave(self) -> None:
        """Disconnect, as a client that closes its connection, and wait until the app has finished."""
        self._left.set()
        await self._task
