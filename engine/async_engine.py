"""AsyncLLMEngine: the engine's step loop on a background thread, requests as async streams.

The forward pass is blocking CPU/GPU work, so it runs on its own thread and never holds up the
event loop (health checks answer while the engine is saturated). Requests and aborts reach the
loop through an inbox; deltas come back through each request's asyncio.Queue.

The engine is built on that thread too, so every parallel CPU op runs there. Under OpenMP each
thread that runs a parallel op owns a team of threads; two teams on a 2-core machine are more
threads than cores, libgomp then stops spinning between ops, and every op from the loop thread
paid a sleep and wake-up (~80 µs): a batch-1 decode step took twice as long as on the main thread
(docs/BENCHMARKS.md, "Serving path").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator

from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput

logger = logging.getLogger(__name__)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig):
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self.engine: LLMEngine | None = None
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._build_and_run, args=(config, built), name="shardserve-engine-loop", daemon=True
        )
        self._thread.start()
        built.wait()
        if self.engine is None:  # the build failed on the loop thread: raise it here, in the caller
            self._thread.join()
            raise self._error

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopped

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request; leaving the iteration early aborts it."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self._error or 'shut down'})")
        self.engine.validate_request(prompt_token_ids, sampling_params)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._inbox.append(("add", request_id, prompt if prompt is not None else prompt_token_ids,
                            list(prompt_token_ids), sampling_params))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wakeup.set()

    @property
    def recent_steps(self) -> deque[tuple[int, int]]:
        """(step number, tokens computed) of the latest steps, appended by the loop thread."""
        return self.engine.recent_steps

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_waiting += sum(1 for item in list(self._inbox) if item[0] == "add")
        return stats

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # ---- the loop thread --------------------------------------------------------------------

    def _build_and_run(self, config: EngineConfig, built: threading.Event) -> None:
        try:
            self.engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 — handed to the constructor, which raises it
            self._error = exc
            return
        finally:
            built.set()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                self._deliver_all(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 — any failure kills the loop; tell every waiter
            logger.exception("engine loop died")
            self._error = exc
            dead = EngineDeadError(f"the engine loop died: {exc!r}")
            for stream in list(self._streams.values()):
                stream.put(dead)

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                _, request_id, prompt, token_ids, params = item
                if request_id not in self._streams:
                    continue  # the client left before the request reached the loop
                try:
                    request = self.engine.add_request(request_id, token_ids, params)
                    request.prompt = prompt if isinstance(prompt, str) else None
                except InvalidRequestError as exc:
                    self._streams[request_id].put(exc)
            else:
                output = self.engine.abort_request(item[1])
                if output is not None:
                    self._deliver(output)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's deltas, handed to each event loop in one callback (one wake-up per step, not one per
        request: at 50 streams that is 49 fewer cross-thread wake-ups of the serving loop per step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)
