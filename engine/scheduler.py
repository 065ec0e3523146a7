"""Token-budget continuous batching (the vLLM v1 model).

There are no prefill and decode phases. Each step hands out at most `max_num_batched_tokens`
tokens: first to RUNNING sequences in admission order (a decode needs one token; a sequence
still working through its prompt takes a chunk), then to WAITING sequences in arrival order,
whose prompts are split across steps when the budget is short. When the block pool cannot
hold a running sequence's next tokens, the newest running sequence is preempted: its blocks
are freed and it returns to the front of WAITING to be recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every token is computed, so the last position's logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch: decodes (one token each) first, then prefill chunks."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()

        scheduled: list[ScheduledChunk] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_tokens):
                victim = self.running.pop()  # newest admitted; never one already scheduled
                self._preempt(victim, now)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing newer is left to schedule
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
            index += 1

        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > budget and not self.chunked_prefill:
                break
            num_tokens = min(remaining, budget)
            # the watermark guards running sequences; with none running, admit whatever fits
            if not self.block_manager.allocate_slots(seq, num_tokens, admitting=bool(self.running)):
                break
            self.waiting.popleft()
            self._admit(seq, now)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens

        for chunk in scheduled:
            if chunk.num_tokens == 1 and not chunk.seq.is_prefilling and chunk.seq.num_output_tokens:
                out.decodes.append(chunk)
            else:
                out.prefills.append(chunk)
        for chunk in out.prefills:
            chunk.seq.request.metrics.prefill_chunks.append((now, chunk.num_tokens, bool(out.decodes)))
        return out

    def _admit(self, seq: Sequence, now: float) -> None:
        metrics = seq.request.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
        elif len(metrics.resumes) < len(metrics.preemptions):
            metrics.resumes.append(now)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence, now: float) -> None:
        """Recompute preemption: drop the sequence's KV and queue it first in WAITING."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.request.metrics.preemptions.append(now)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark `seq` finished and return its blocks, wherever it is queued."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason, stop_reason)
