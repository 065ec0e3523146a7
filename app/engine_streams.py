"""One engine request per prompt, merged into one stream of (prompt index, delta).

The first delta is awaited before a response starts, so a request the engine rejects becomes an HTTP
error rather than a broken stream. Leaving the stream early (client gone, task cancelled) closes every
engine stream, which aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engine.config import SamplingParams


@dataclass
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


async def start_generation(engine: Any, request_id: str, prompts: Sequence[Prompt],
                           params: Sequence[SamplingParams]) -> AsyncIterator[tuple[int, Any]]:
    """Submit every prompt as `{request_id}-{i}` and wait for the first delta; engine errors raise here."""
    deltas = _merged_deltas(engine, request_id, prompts, params)
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await deltas.aclose()
        raise
    return _resume(first, deltas)


async def _resume(first, deltas: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    async with aclosing(deltas):
        if first is None:
            return
        yield first
        async for item in deltas:
            yield item


async def _merged_deltas(engine: Any, request_id: str, prompts: Sequence[Prompt],
                         params: Sequence[SamplingParams]) -> AsyncIterator[tuple[int, Any]]:
    streams = [
        engine.generate(p.token_ids, sp, request_id=f"{request_id}-{i}", prompt=p.text)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for delta in stream:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, finished))
        except BaseException as e:  # noqa: B036 - handed to the consumer, which re-raises
            queue.put_nowait((index, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
