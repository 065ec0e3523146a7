"""A small stand-in for AsyncLLMEngine with the same interface, for fast route tests without a model."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from engine.sequence import RequestMetrics
from engine.validation import check_request


class ByteTokenizer:
    """Token id = byte value; the chat template is `<role>content` lines then `<assistant>`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text) if tokenize else text


@dataclass
class FakeStats:
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_free_blocks: int = 64
    num_total_blocks: int = 64
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0


@dataclass
class FakeCompletion:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class FakeOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def fake_next_token(prompt_ids: list[int], position: int, choice: int, greedy: bool) -> int:
    """Lowercase letters, a deterministic function of the prompt, position and (if sampling) choice."""
    return 97 + (sum(prompt_ids) + 7 * position + (0 if greedy else 3 * choice)) % 26


class FakeEngine:
    def __init__(self, max_model_len: int = 64):
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=256)
        self.is_running = True
        self.stats_now = FakeStats()
        self.request_ids: list[str] = []
        self.sampling_params: list = []  # what each generate() was asked for
        self.num_generated_tokens = 0
        self.fail_with: Exception | None = None  # raised by the next generate() before its first delta

    def stats(self) -> FakeStats:
        return self.stats_now

    def shutdown(self) -> None:
        self.is_running = False

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        sp = sampling_params
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        sp = check_request(prompt_token_ids, sp, self.max_model_len, self.model_config.vocab_size)  # the engine's rules
        self.request_ids.append(request_id)
        self.sampling_params.append(sp)
        texts = [""] * sp.n
        done = [False] * sp.n
        metrics = RequestMetrics(arrival_time=time.time())
        self.stats_now.num_running += 1
        try:
            for position in range(sp.max_tokens):
                await asyncio.sleep(0)
                metrics.first_scheduled_time = metrics.first_scheduled_time or time.time()
                metrics.first_token_time = metrics.first_token_time or time.time()
                delta = FakeOutput(request_id, prompt, prompt_token_ids, metrics=metrics)
                for i in range(sp.n):
                    if done[i]:
                        continue
                    token = fake_next_token(prompt_token_ids, position, i, sp.greedy)
                    self.num_generated_tokens += 1
                    text = chr(token)
                    texts[i] += text
                    finish = "length" if position == sp.max_tokens - 1 else None
                    if any(stop in texts[i] for stop in sp.stop):  # single-character stops only
                        text, finish = "", "stop"
                    logprobs = None
                    if sp.logprobs is not None:
                        alternatives = {97 + (token - 97 + k) % 26: -1.0 - k for k in range(1, sp.logprobs + 1)}
                        logprobs = [{token: -0.5, **alternatives}]
                    done[i] = finish is not None
                    delta.outputs.append(FakeCompletion(i, text, [token], logprobs, finish_reason=finish))
                delta.finished = all(done)
                if delta.finished:
                    metrics.finished_time = time.time()
                yield delta
                if delta.finished:
                    return
        finally:
            self.stats_now.num_running -= 1
