"""coalesce_stream: fewer writes, the same events, the first at once, and closing reaches the engine stream; and the
replica app that the deployment and the tests build streams through it as its settings say."""

import asyncio
import json

from app.api import StreamBatching, coalesce_stream
from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from tests.app.asgi_stream import StreamingPost
from tests.app.fake_engine import FakeEngine

MODEL = "fake-model"


class Events:
    """An SSE event source the test feeds by hand; records whether it was closed."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def __aiter__(self):
        return self.gen()

    async def gen(self):
        try:
            while (event := await self.queue.get()) is not None:
                yield event
        finally:
            self.closed = True


def event(i: int) -> str:
    return f'data: {{"i": {i}}}\n\n'


def test_within_one_interval_the_first_event_goes_at_once_and_the_rest_together_at_the_end():
    async def run():
        source = Events()
        stream = coalesce_stream(aiter(source), StreamBatching(interval_s=3600))
        source.queue.put_nowait(event(0))
        first = await stream.__anext__()  # written before any later event exists
        for i in range(1, 5):
            source.queue.put_nowait(event(i))
        source.queue.put_nowait(None)
        rest = [write async for write in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert first == event(0)
    assert rest == ["".join(event(i) for i in range(1, 5))]


def test_interval_zero_writes_every_event_on_its_own():
    async def run():
        source = Events()
        for i in range(4):
            source.queue.put_nowait(event(i))
        source.queue.put_nowait(None)
        return [write async for write in coalesce_stream(aiter(source), StreamBatching(interval_s=0))]

    assert asyncio.run(run()) == [event(i) for i in range(4)]


def test_leaving_the_stream_early_closes_the_source():
    async def run():
        source = Events()
        stream = coalesce_stream(aiter(source), StreamBatching(interval_s=0))
        source.queue.put_nowait(event(0))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        return source.closed

    assert asyncio.run(run())


def test_the_interval_stretches_to_cap_the_replicas_writes_per_second():
    batching = StreamBatching(interval_s=0.05, max_writes_per_s=200)
    assert batching.interval() == 0.05
    batching.active = 10
    assert batching.interval() == 0.05  # 10 streams x 20 writes/s: within the cap
    batching.active = 50
    assert batching.interval() == 0.25  # 50 streams share 200 writes/s
    assert StreamBatching(interval_s=0.05, max_writes_per_s=0, active=50).interval() == 0.05


def test_open_streams_are_counted_while_they_run():
    async def run():
        batching = StreamBatching(interval_s=0)
        source = Events()
        stream = coalesce_stream(aiter(source), batching)
        source.queue.put_nowait(event(0))
        await stream.__anext__()
        during = batching.active
        source.queue.put_nowait(None)
        assert [write async for write in stream] == []
        return during, batching.active

    assert asyncio.run(run()) == (1, 0)


async def test_the_replica_app_batches_its_streams_as_its_settings_say():
    engine = FakeEngine()

    async def stream_writes(**settings) -> list[bytes]:
        app = build_replica_app(engine, ServeArgs(model=MODEL, **settings), ReplicaObservability(engine, MODEL))
        post = StreamingPost(app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                      "temperature": 0, "stream": True})
        assert await post.status() == 200
        return await post.writes()

    def events(writes: list[bytes]) -> list[str]:
        frames = b"".join(writes).decode().split("\n\n")[:-1]
        return [json.loads(f[len("data: "):])["choices"][0]["text"] if f != "data: [DONE]" else "[DONE]"
                for f in frames]

    # an interval longer than the test: the first event at once, then the other 7 and [DONE] in one write
    batched = await stream_writes(stream_interval_ms=3_600_000, max_stream_writes_per_s=0)
    assert [w.count(b"data: ") for w in batched] == [1, 8]
    each = await stream_writes(stream_interval_ms=0, max_stream_writes_per_s=0)
    assert [w.count(b"data: ") for w in each] == [1] * 9
    assert events(batched) == events(each)
    assert ServeArgs().stream_interval_ms > 0  # what replicas run with unless told otherwise
