"""coalesce_stream: fewer writes, the same events, the first at once, and closing reaches the engine stream."""

import asyncio

from app.api import StreamBatching, coalesce_stream


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
