"""What the engine returns: vLLM-shaped request and completion outputs, and engine stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import RequestMetrics
from engine.spec_decode.stats import SpeculationStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per token: chosen id and the top-n ids
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    def merge(self, delta: RequestOutput) -> None:
        """Fold a streamed delta into this accumulated output."""
        by_index = {o.index: o for o in self.outputs}
        for new in delta.outputs:
            acc = by_index.get(new.index)
            if acc is None:
                acc = CompletionOutput(new.index, "", [], [] if new.logprobs is not None else None)
                self.outputs.append(acc)
                by_index[new.index] = acc
            acc.text += new.text
            acc.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                acc.logprobs = (acc.logprobs or []) + new.logprobs
            acc.cumulative_logprob = new.cumulative_logprob
            acc.finish_reason = new.finish_reason
            acc.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_steps: int = 0
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)  # "recompute" / "swap" -> count
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens whose KV was already cached
    # speculative decoding's counters (proposed, accepted, emitted tokens, acceptance lengths); None when off
    speculation: SpeculationStats | None = None
