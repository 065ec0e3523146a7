"""One engine request per prompt, merged into one stream of (prompt index, delta), each request observed as it goes.

`start_generation` returns once the first delta is in hand, so a request the engine rejects becomes an HTTP
error rather than a broken stream. Leaving the stream early (client gone, task cancelled) closes every engine
stream, which aborts its request and frees its KV blocks. Each engine request's RequestRecord goes to
`on_finished` when its final delta arrives, or, for a request left before that, when the stream is left
(its choices' finish reason is then "abort").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from app.observability.records import RequestContext, RequestRecord, RequestTally
from app.prompts import Prompt
from engine.config import SamplingParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine
    from engine.outputs import RequestOutput

logger = logging.getLogger("shardserve.api")

OnRequestFinished = Callable[[RequestRecord], None]


async def start_generation(engine: AsyncLLMEngine, request_id: str, prompts: Sequence[Prompt],
                           params: Sequence[SamplingParams], context: RequestContext,
                           on_finished: OnRequestFinished | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Submit every prompt as `{request_id}-{i}` and wait for the first delta; engine errors raise here."""
    deltas = _generate(engine, request_id, prompts, params, context, on_finished)
    try:
        await anext(deltas)  # runs the generator up to its first delta (see _generate)
    except BaseException:
        await deltas.aclose()
        raise
    return deltas


async def _generate(engine: AsyncLLMEngine, request_id: str, prompts: Sequence[Prompt],
                    params: Sequence[SamplingParams], context: RequestContext,
                    on_finished: OnRequestFinished | None) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
    """Yields None once the first delta has arrived (start_generation waits for that), then every delta."""
    streams = _EngineStreams([
        engine.generate(p.token_ids, sp, request_id=f"{request_id}-{i}", prompt=p.text)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ])
    tallies = [RequestTally(sp) for sp in params] if on_finished is not None else None
    try:
        item = await streams.next()
        yield None
        while item is not None:
            if tallies is not None:
                index, delta = item
                tallies[index].add(delta)
                if delta.finished:
                    _report(on_finished, tallies[index], context)
            yield item
            item = await streams.next()
    finally:
        # recorded before the awaits below: a cancelled task may be cancelled again at each of them
        for tally in tallies or ():
            if tally.left_unfinished:
                _report(on_finished, tally, context)
        await streams.close()


def _report(on_finished: OnRequestFinished, tally: RequestTally, context: RequestContext) -> None:
    try:
        on_finished(tally.record(context))
    except Exception:  # observing a request must never fail it
        logger.exception("could not record request %s", tally.last.request_id)


class _EngineStreams:
    """The engine's delta streams of one OpenAI request, read as (prompt index, delta) in arrival order.

    One stream is read directly; several are read by one task each into a queue, so that a slow prompt does
    not hold back the deltas of the others.
    """

    _FINISHED = object()

    def __init__(self, streams: list[AsyncGenerator[RequestOutput, None]]):
        self.streams = streams
        self.remaining = len(streams)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        if len(streams) > 1:
            self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next delta of any stream; None once every stream has ended."""
        if not self.tasks:
            delta = await anext(self.streams[0], None)
            return None if delta is None else (0, delta)
        while self.remaining:
            index, item = await self.queue.get()
            if item is self._FINISHED:
                self.remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        return None

    async def close(self) -> None:
        """Close every engine stream (aborting the requests still running)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()

    async def _pump(self, index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for delta in stream:
                self.queue.put_nowait((index, delta))
            self.queue.put_nowait((index, self._FINISHED))
        except BaseException as e:  # noqa: B036 - handed to the reader, which re-raises
            self.queue.put_nowait((index, e))
        finally:
            await stream.aclose()
