"""What one engine request did, from the app's side: a RequestRecord, made when its final delta arrives.

The app knows when a request came in, under which trace context and as which operation (RequestContext);
the engine's final output knows its time stamps (engine/sequence.py RequestMetrics). A RequestTally counts a
request's output as its deltas pass (a delta holds only the new tokens) and joins both into the record that
app/observability/metrics.py and app/observability/tracing.py consume. This module imports neither.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context

if TYPE_CHECKING:
    from engine.config import SamplingParams
    from engine.outputs import RequestOutput


@dataclass(frozen=True)
class RequestContext:
    """What the app knows of a request and the engine does not, taken when the app hands it to the engine."""

    operation: str  # "chat" | "text_completion" (OpenTelemetry's gen_ai.operation.name)
    model: str  # the served model name
    received_time: float = field(default_factory=time.time)
    # the caller's trace context (its `traceparent`, made current by TraceContextMiddleware): the spans' parent
    trace_context: otel_context.Context = field(default_factory=otel_context.get_current)


@dataclass
class RequestRecord:
    """One engine request at its end: what was asked, what came out, and the engine's time stamps (time.time())."""

    request_id: str  # the engine's id: "<response id>-<prompt index>"
    operation: str  # "chat" | "text_completion"
    model: str
    num_prompt_tokens: int
    num_output_tokens: int  # over all choices
    num_cached_tokens: int
    max_tokens: int | None  # as the client asked; None: the rest of the context
    temperature: float
    top_p: float
    finish_reasons: list[str]
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    prefill_chunks: list[tuple[float, int, bool]] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    resumes: list[float] = field(default_factory=list)
    received_time: float | None = None  # when the replica's API handed the request to the engine
    longest_choice_tokens: int | None = None  # output tokens of the longest choice (n > 1); None = all of them
    trace_context: otel_context.Context | None = None  # the parent of the request's spans; None: a new trace
    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed, and of those accepted
    spec_accepted_tokens: int = 0

    @property
    def response_id(self) -> str:
        return self.request_id.rsplit("-", 1)[0]

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return (self.first_scheduled_time or self.finished_time) - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return (self.first_token_time or self.finished_time) - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        return None if self.first_token_time is None else self.finished_time - self.first_token_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two tokens)."""
        # the request finishes with its longest choice, whose tokens came one per step after the first
        num_tokens = self.longest_choice_tokens or self.num_output_tokens
        if self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time


@dataclass
class RequestTally:
    """One engine request's deltas as they pass: output tokens and finish reason per choice, and the last delta."""

    params: SamplingParams
    tokens_per_choice: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    last: RequestOutput | None = None

    def add(self, delta: RequestOutput) -> None:
        for out in delta.outputs:
            self.tokens_per_choice[out.index] = self.tokens_per_choice.get(out.index, 0) + len(out.token_ids)
            if out.finish_reason is not None:
                self.finish_reasons[out.index] = out.finish_reason
        self.last = delta

    @property
    def left_unfinished(self) -> bool:
        """Deltas came, but not the final one: the stream was left (the engine aborts such a request)."""
        return self.last is not None and not self.last.finished

    def record(self, context: RequestContext) -> RequestRecord:
        """The request's record from its last delta; a choice without a finish reason was aborted."""
        final = self.last
        assert final is not None, "a request without deltas has nothing to record"
        m = final.metrics
        reasons = {i: self.finish_reasons.get(i, "abort") for i in range(self.params.n)}
        return RequestRecord(
            request_id=final.request_id, operation=context.operation, model=context.model,
            num_prompt_tokens=len(final.prompt_token_ids), num_output_tokens=sum(self.tokens_per_choice.values()),
            num_cached_tokens=final.num_cached_tokens, max_tokens=self.params.max_tokens,
            temperature=self.params.temperature, top_p=self.params.top_p,
            finish_reasons=[reasons[i] for i in sorted(reasons)],
            arrival_time=m.arrival_time, first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time, finished_time=m.finished_time or time.time(),
            prefill_chunks=list(m.prefill_chunks), preemptions=list(m.preemptions), resumes=list(m.resumes),
            received_time=context.received_time, longest_choice_tokens=max(self.tokens_per_choice.values(), default=0),
            trace_context=context.trace_context,
            spec_proposed_tokens=m.spec_proposed_tokens, spec_accepted_tokens=m.spec_accepted_tokens,
        )
