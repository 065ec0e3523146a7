"""AsyncLLMEngine: the engine's step loop on a background thread, requests as async streams.

The forward pass is blocking CPU/GPU work, so it runs on its own thread and never holds up the
event loop (health checks answer while the engine is saturated). Requests and aborts reach the
loop through an inbox; deltas come back through each request's asyncio.Queue.

The engine is built on that thread too, so every parallel CPU op runs there. Under OpenMP each
thread that runs a parallel op owns a team of threads; two teams on a 2-core machine are more
threads than cores, libgomp then stops spinning between ops, and every op from the loop thread
paid a sleep and wake-up (~80 µs): a batch-1 decode step took twice as long as on the main thread
(docs/BENCHMARKS.md, "Serving path").

Lifecycle: the thread runs an `_EngineLoop`, which never refers to the `AsyncLLMEngine` that callers
hold, so that one can be garbage-collected; its `weakref.finalize` (run by `shutdown()`, leaving a
`with` / `async with` block, garbage collection or interpreter exit) stops the loop, and the loop
thread shuts the engine down (worker actors, placement group, swap thread) as it leaves.

Failure: a step that raises (a dead worker, a device error) ends the loop; as it leaves it fails every
open stream with EngineDeadError, and `generate` refuses new requests from then on. Opening a stream and
that farewell take one lock, so a request that arrives while the loop dies is refused or failed, never
left waiting. While idle the loop asks the executor every `IDLE_HEALTH_CHECK_S` whether its workers are
alive, so a worker that dies between requests marks the engine dead without waiting for one. A loop that is
stuck instead (in a step whose collective waits on the lost rank) never notices: `unnoticed_rank_loss`, which
Serve's health check asks from another thread, reports a rank Ray has reported lost for `LOST_RANK_GRACE_S`
while the loop still runs, with the loop thread's stack, so that Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.sequence import Request

logger = logging.getLogger("shardserve.engine")

# How long shutdown waits for the loop thread to finish its step and release the engine.
SHUTDOWN_TIMEOUT_S = 30.0
# How often an idle loop checks that the executor's workers are alive (a local, non-blocking Ray call).
IDLE_HEALTH_CHECK_S = 0.5
# how long the loop must have had nothing to do before it runs a unit of idle work (LLMEngine.warm_up_idle)
WARM_UP_QUIET_S = 0.05
# How long a rank may be reported lost while the loop still runs before the loop counts as stuck: past the time the
# loop takes to act on a loss (at once in a step, within IDLE_HEALTH_CHECK_S while idle, then up to the executor's
# 5 s wait for Ray's account of the failure).
LOST_RANK_GRACE_S = 10.0


# What callers put in the loop's inbox (any thread); the loop thread applies them before its next step.
@dataclass(frozen=True)
class AddRequest:
    request: Request  # made (and validated) by LLMEngine.make_request in the caller's thread


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    pass


InboxMessage = AddRequest | AbortRequest | AbortAll


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = False  # a delta has gone to it: its first (the first token) is never held back

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class _EngineLoop:
    """The loop thread's side: the engine it builds and steps, the inbox it drains, the streams it feeds."""

    def __init__(self, config: EngineConfig, on_dead: Callable[[str], None] | None = None,
                 delivery_interval_s: float = 0.0):
        self.on_dead = on_dead
        self.delivery_interval_s = delivery_interval_s
        self.held: list[RequestOutput] = []  # deltas not yet handed to their event loops
        self.last_delivery = 0.0
        self.inbox: deque[InboxMessage] = deque()
        self.wakeup = threading.Event()
        self.streams: dict[str, _Stream] = {}
        self.error: BaseException | None = None
        self.stopped = False
        self.warming_up = True  # until the engine's idle warm-up is done (LLMEngine.warm_up_idle)
        # set, under `streams_lock`, once the loop has failed its open streams: no stream opens after it
        self.closed = False
        self.streams_lock = threading.Lock()
        # when `unnoticed_rank_loss` first saw a lost rank (Serve's health check's thread), and whether it logged it
        self.rank_lost_at: float | None = None
        self.stuck_logged = False
        self.engine: LLMEngine | None = None
        built = threading.Event()
        self.thread = threading.Thread(
            target=self._build_and_run, args=(config, built), name="shardserve-engine-loop", daemon=True
        )
        self.thread.start()
        built.wait()
        if self.engine is None:  # the build failed on the loop thread: raise it here, in the caller
            self.thread.join()
            raise self.error

    @property
    def death_reason(self) -> str:
        return f"the engine loop died: {self.error!r}" if self.error is not None else "the engine was shut down"

    def open_stream(self, request_id: str, stream: _Stream) -> None:
        """Register a request's stream, unless the loop has already failed its streams (then it raises)."""
        with self.streams_lock:
            if self.closed:
                raise EngineDeadError(self.death_reason)
            if request_id in self.streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self.streams[request_id] = stream

    def stop(self) -> None:
        """Ask the loop to leave (it then releases the engine) and wait for it, unless called on it."""
        self.stopped = True
        self.wakeup.set()
        if threading.current_thread() is self.thread:  # e.g. a garbage collection that ran on the loop
            return
        self.thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        if self.thread.is_alive():
            logger.warning("the engine loop did not stop within %.0f s; it releases the engine when its step "
                           "returns", SHUTDOWN_TIMEOUT_S)

    def _build_and_run(self, config: EngineConfig, built: threading.Event) -> None:
        try:
            self.engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 — handed to the constructor, which raises it
            self.error = exc
            return
        finally:
            built.set()
        try:
            self._run()
        finally:
            self._release()

    def _run(self) -> None:
        try:
            while not self.stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    if self.warming_up:
                        # idle work only after a quiet spell (a client sending requests one after another never
                        # waits for it), one unit at a time (a request that comes then waits for one product)
                        if not self.wakeup.wait(WARM_UP_QUIET_S):
                            self.warming_up = self.engine.warm_up_idle()
                        self.wakeup.clear()
                        continue
                    if not self.wakeup.wait(IDLE_HEALTH_CHECK_S):
                        self.engine.check_health()  # raises when a worker died while nothing ran
                    self.wakeup.clear()
                    continue
                self._deliver_all(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 — any failure kills the loop; tell every waiter
            logger.exception("engine loop died")
            self.error = exc

    def _release(self) -> None:
        """End every stream still open, then shut the engine down, on this thread like everything else."""
        self._hand_over()
        with self.streams_lock:
            self.closed = True
            open_streams = list(self.streams.values())
        for stream in open_streams:
            stream.put(EngineDeadError(self.death_reason))
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 — nobody is left to raise it to
            logger.exception("engine shutdown failed")
        if self.error is not None and self.on_dead is not None:
            self.on_dead(self.death_reason)

    def _drain_inbox(self) -> None:
        while self.inbox:
            message = self.inbox.popleft()
            if isinstance(message, AddRequest):
                request_id = message.request.request_id
                if request_id not in self.streams:
                    continue  # the client left before the request reached the loop
                try:
                    self.engine.add(message.request)
                except InvalidRequestError as exc:  # an id still held by a request whose abort is queued
                    self.streams[request_id].put(exc)
            elif isinstance(message, AbortRequest):
                output = self.engine.abort_request(message.request_id)
                if output is not None:
                    self._deliver(output)
            else:  # AbortAll
                for request_id in list(self.engine.requests):
                    self._deliver(self.engine.abort_request(request_id))

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's deltas, handed to each event loop in one callback (one wake-up per step, not one per
        request: at 50 streams that is 49 fewer cross-thread wake-ups of the serving loop per step). With a
        delivery interval, deltas are held and handed over together once it has passed since the last
        hand-over, or at once where one is a request's first or last: the serving loop then wakes up once
        per interval instead of once per step (on a CPU host each wake-up takes a core from the step's
        threads), while TTFT and the end of a request are not delayed."""
        self.held.extend(outputs)
        if not self.held:
            return
        if (self.delivery_interval_s <= 0 or time.monotonic() - self.last_delivery >= self.delivery_interval_s
                or any(output.finished or not self._started(output.request_id) for output in outputs)):
            self._hand_over()

    def _started(self, request_id: str) -> bool:
        stream = self.streams.get(request_id)
        return stream is None or stream.started

    def _hand_over(self) -> None:
        """Hand every held delta to its event loop."""
        if not self.held:
            return
        held, self.held = self.held, []
        self.last_delivery = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in held:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream.started = True
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    def _deliver(self, output: RequestOutput) -> None:
        self._hand_over()  # what the step loop held for this request goes first
        stream = self.streams.get(output.request_id)
        if stream is not None:
            stream.put(output)


class _LoopSlot:
    """The engine loop an AsyncLLMEngine runs now: `restart` puts a new one in place of one that died."""

    def __init__(self, engine_loop: _EngineLoop):
        self.engine_loop = engine_loop
        self.lock = threading.Lock()  # a restart and a shutdown, one at a time
        self.shut_down = False

    def stop(self) -> None:
        with self.lock:
            self.shut_down = True
            engine_loop = self.engine_loop
        engine_loop.stop()


class AsyncLLMEngine:
    """The engine for serving: requests in as `generate` streams, from any event loop."""

    def __init__(self, config: EngineConfig, on_dead: Callable[[str], None] | None = None,
                 delivery_interval_s: float = 0.0):
        """`on_dead(reason)` runs on the loop thread when a failure (not a shutdown) has ended the loop, after
        every open stream got its error and the engine was released (it may `restart` the engine).
        `delivery_interval_s`: a stream gets its deltas at most this often, several at once, except its first and
        its last (0: after every step); a server whose streams write at most that often (app/api.py
        StreamBatching) loses nothing by it."""
        self._config = config
        self._on_dead = on_dead
        self._delivery_interval_s = delivery_interval_s
        self._slot = _LoopSlot(_EngineLoop(config, on_dead, delivery_interval_s))
        # registered after the build, so at exit it runs before the executor's own finalizer
        self._stop = weakref.finalize(self, self._slot.stop)

    @property
    def _engine_loop(self) -> _EngineLoop:
        return self._slot.engine_loop

    def restart(self) -> None:
        """Build a new engine, from the same config on a new loop thread, in place of one that a failure ended
        (app/engine_recovery.py rebuilds a replica's engine this way); raises what the build raises. Until it is
        built, requests are refused as by the dead engine; streams of the dead one have had their error."""
        dead = self._slot.engine_loop
        if dead.error is None:
            raise RuntimeError("only an engine that a failure ended restarts")
        gc.collect()  # the dead engine's runner (weights, KV cache) went with its shutdown: its memory goes first
        if torch.cuda.is_initialized():
            # and on a GPU back to the device, where the new KV cache is sized from what is free
            torch.cuda.empty_cache()
        engine_loop = _EngineLoop(self._config, self._on_dead, self._delivery_interval_s)
        with self._slot.lock:
            shut_down = self._slot.shut_down
            if not shut_down:
                self._slot.engine_loop = engine_loop
        if shut_down:  # shut down while it was being built: it goes too
            engine_loop.stop()
            raise EngineDeadError("the engine was shut down while it was rebuilt")

    @property
    def engine(self) -> LLMEngine:
        return self._engine_loop.engine

    @property
    def loop_thread(self) -> threading.Thread:
        """The thread that built the engine and runs its steps."""
        return self._engine_loop.thread

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
        engine_loop = self._engine_loop
        return (engine_loop.thread.is_alive() and engine_loop.error is None and not engine_loop.stopped
                and not engine_loop.closed)

    def unnoticed_rank_loss(self, grace_s: float = LOST_RANK_GRACE_S) -> str | None:
        """A rank Ray has reported lost for `grace_s` while the engine loop still runs: the loop is stuck (e.g. in a
        collective that waits on that rank) and will not mark the engine dead. Any thread, non-blocking (Serve's
        health check fails on it, so Serve replaces the replica); logs the loop thread's stack the first time.
        None while every rank lives or the loop has acted on the loss."""
        engine_loop = self._engine_loop
        lost = engine_loop.engine.lost_rank() if self.is_running else None
        if lost is None:
            engine_loop.rank_lost_at = None
            return None
        now = time.monotonic()
        if engine_loop.rank_lost_at is None:
            engine_loop.rank_lost_at = now
        waited = now - engine_loop.rank_lost_at
        if waited < grace_s:
            return None
        frame = sys._current_frames().get(engine_loop.thread.ident)
        where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(no stack)"
        reason = f"{lost}, reported {waited:.1f} s ago, and the engine loop has not acted on it; it is at:\n{where}"
        if not engine_loop.stuck_logged:
            engine_loop.stuck_logged = True
            logger.error("the engine loop is stuck: %s", reason)
        return reason

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (a step's exception, or shutdown); None while it runs."""
        return None if self.is_running else self._engine_loop.death_reason

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request; leaving the iteration early aborts it."""
        engine_loop = self._engine_loop
        if not self.is_running:
            raise EngineDeadError(engine_loop.death_reason)
        if sampling_params.structured_outputs is not None:  # compiled off the event loop and the step loop
            await asyncio.wrap_future(self.engine.grammar_compiler.submit(sampling_params.structured_outputs))
        request = self.engine.make_request(request_id, prompt if prompt is not None else prompt_token_ids,
                                           sampling_params, prompt_token_ids=list(prompt_token_ids))
        stream = _Stream(asyncio.get_running_loop())
        engine_loop.open_stream(request_id, stream)  # raises if the loop died since the check above
        engine_loop.inbox.append(AddRequest(request))
        engine_loop.wakeup.set()
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
            engine_loop.streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._engine_loop.inbox.append(AbortRequest(request_id))
        self._engine_loop.wakeup.set()

    def abort_all(self) -> None:
        """Abort every request sent so far (a drain's deadline): each stream ends with finish_reason "abort"."""
        self._engine_loop.inbox.append(AbortAll())
        self._engine_loop.wakeup.set()

    @property
    def recent_steps(self) -> deque[tuple[int, int]]:
        """(step number, tokens computed) of the latest steps, appended by the loop thread."""
        return self.engine.recent_steps

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_waiting += sum(1 for message in list(self._engine_loop.inbox) if isinstance(message, AddRequest))
        return stats

    def shutdown(self) -> None:
        """Stop the loop, end open streams, release the engine; idempotent."""
        self._stop()

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.to_thread(self.shutdown)  # waits for a step to finish: not on the event loop
