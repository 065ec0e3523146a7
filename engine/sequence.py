"""A request and its sequences: token state, status, and the timestamps tracing reads.

There is no prefill phase and no decode phase: each sequence has `num_tokens` (prompt plus
outputs) and `num_computed_tokens` (tokens whose K/V are in the cache). A step computes some
of the rest; when it reaches the end, the last position's logits give the next token.
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import SamplingParams
from kernels.sampling import sequence_seed

if TYPE_CHECKING:
    from engine.structured_output.grammar import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock stamps (time.time()) of one request's life, filled in by the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # (time, num_tokens, shared_with_decode) for every prefill chunk scheduled
    prefill_chunks: list[tuple[float, int, bool]] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    resumes: list[float] = field(default_factory=list)
    # speculative decoding: tokens proposed for this request's sequences, and of those accepted
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


_seq_ids = itertools.count()


class Sequence:
    """One generated continuation (a request with n=2 has two)."""

    def __init__(
        self,
        request: Request,
        index: int,
        prompt_token_ids: list[int],
    ):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        # prefix caching (engine/prefix_cache.py): hashes of the full blocks of token_ids, and how
        # many leading entries of block_table the block manager has already offered to the cache
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        # swap preemption: the host blocks holding the KV while SWAPPED, and the copy that fills them
        self.host_block_table: list[int] = []
        self.swap_out_ticket: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        # the counter-based noise stream this sequence draws from (kernels/sampling.py): the request's
        # seed makes it reproducible; without one, fresh entropy per sequence
        seed = request.sampling_params.seed
        self.sampling_seed = sequence_seed(seed, index) if seed is not None else secrets.randbits(64)
        # the request's constraint, matched over this sequence's outputs (engine/structured_output/)
        self.grammar: SequenceGrammar | None = None
        # speculative decoding's back-off (engine/scheduler.py): verifications in a row that kept no proposal,
        # and the output length before which this sequence proposes nothing
        self.spec_misses = 0
        self.spec_resume_at = 0
        # detokenizer state (engine/detokenizer.py)
        self.text = ""
        self.num_emitted_chars = 0
        self.prefix_offset = max(0, self.num_prompt_tokens - 5)
        self.read_offset = self.num_prompt_tokens
        # how much of token_ids / logprobs the last RequestOutput delta already carried
        self.num_emitted_tokens = 0
        self.finish_reported = False

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token is still uncomputed (a prompt, or a recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )


class Request:
    """A client request: a prompt, sampling params and n sequences."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.seqs = [Sequence(self, i, prompt_token_ids) for i in range(sampling_params.n)]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
