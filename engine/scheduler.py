"""Token-budget continuous batching (the vLLM v1 model).

There are no prefill and decode phases. Each step hands out at most `max_num_batched_tokens`
tokens: first to RUNNING sequences in admission order (a decode needs one token; a sequence
still working through its prompt takes a chunk), then to WAITING sequences in arrival order,
whose prompts are split across steps when the budget is short. When the block pool cannot
hold a running sequence's next tokens, the newest running sequence is preempted: either its
blocks are freed and it returns to the front of WAITING to be recomputed later ("recompute"),
or they are copied to host blocks and it waits in SWAPPED ("swap"; recompute when the host pool
is full). SWAPPED sequences come back, without recomputing, before any new prompt is admitted.

With prefix caching, a sequence leaving WAITING starts with every cached block of its longest
cached prefix: those tokens count as computed and its prefill starts after them.

A step is `schedule()` -> the executor's forward pass and the sampler -> `update_from_output()`: the
scheduler owns each sequence's progress, so it advances the computed tokens, appends the sampled ones
and finishes the sequences that stop (engine/stopping.py). It also owns the KV blocks: it builds the
block manager, and learns from `swap_outs_done` when a swap-out's device blocks may be reused.

With speculative decoding (engine/spec_decode/), a decoding sequence with k proposed tokens is scheduled
as a chunk of k+1 tokens (the budget counts them all), every position of it is sampled, and
`update_from_output` keeps the proposals the target agreed with: the computed tokens and the block table
roll back past the first rejected one (only real tokens' full blocks are ever hashed for the prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampler import SampledToken
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.ngram import NgramProposer, Proposer
from engine.spec_decode.stats import SpeculationStats
from engine.spec_decode.verify import SpeculativeRow, num_accepted, sampling_rows
from engine.stopping import StopChecker

logger = logging.getLogger("shardserve.engine")

# A sequence whose proposals all miss this many verifications in a row stops proposing for 1 output token,
# then 2, 4, ... up to SPEC_MAX_PAUSE_TOKENS (one accepted proposal resets it): a load that does not repeat
# itself (random prompts) then runs at about the speed of speculation off. Exactness does not depend on it.
SPEC_MISSES_BEFORE_PAUSE = 2
SPEC_MAX_PAUSE_TOKENS = 32


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (proposals included)
    # speculative decoding: tokens proposed after the sequence's last one, computed (and verified) with it
    proposals: list[int] = field(default_factory=list)

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every token is computed, so the last position's logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens + len(self.proposals)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk computes: the sequence's own, then its proposals."""
        start = self.seq.num_computed_tokens
        return self.seq.token_ids[start : start + self.num_tokens - len(self.proposals)] + self.proposals


@dataclass
class SchedulerOutput:
    """One step's batch: decodes (one token each) first, then prefill chunks."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # KV block copies the runner makes before this step's forward pass (block ids on every rank)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swap_out_ticket: int | None = None  # names this step's swap-outs when the runner reports them done
    # sequences whose every token is computed after this step, in batch order (decodes, then prefills):
    # each gets one sampled token, from the logits of its chunk's last position
    sampled_seqs: list[Sequence] = field(default_factory=list)
    # each sampled sequence's proposals (speculative decoding): every position of its chunk is sampled
    sampled_proposals: list[list[int]] = field(default_factory=list)

    @property
    def sampling_rows(self) -> list[Sequence | SpeculativeRow]:
        """What the sampler draws for, in the logits' row order: one row per sampled position."""
        return [row for seq, proposals in zip(self.sampled_seqs, self.sampled_proposals)
                for row in (sampling_rows(seq, proposals) if proposals else [seq])]

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        """No tokens to compute (there may still be swap copies to start)."""
        return not self.decodes and not self.prefills

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        num_host_blocks: int,
        stop_checker: StopChecker,
        proposer: Proposer | None = None,
    ):
        """`num_blocks` device KV blocks (every rank holds as many), `num_host_blocks` for swap preemption
        (0: swapping falls back to recompute). With speculative decoding the n-gram proposer is built here;
        a draft model's (engine/spec_decode/draft.py, which runs a model) is built by the engine and given."""
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.chunked_prefill = config.enable_chunked_prefill
        self.preemption_mode = config.preemption_mode
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.swapped: deque[Sequence] = deque()  # swapped in from the front
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.num_schedules = 0
        self.speculative = config.speculative_config
        self.proposer = proposer
        spec = self.speculative
        if spec is not None and proposer is None:
            if spec.method != "ngram":
                raise ValueError(f"speculative method {spec.method} needs its proposer built by the engine")
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.spec_stats = SpeculationStats(self.speculative.num_speculative_tokens if self.speculative else 0)

    @property
    def num_preemptions(self) -> int:
        return sum(self.num_preemptions_by_mode.values())

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def has_swap_outs_in_flight(self) -> bool:
        """Some device blocks are still being copied to the host (nothing can reuse them yet)."""
        return bool(self.block_manager.swap_outs_in_flight)

    def swap_outs_done(self, tickets: list[int]) -> None:
        """The executor finished these swap-outs (`SchedulerOutput.swap_out_ticket`): their device blocks are free."""
        for ticket in tickets:
            self.block_manager.complete_swap_out(ticket)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()
        ticket = self.num_schedules
        self.num_schedules += 1
        manager = self.block_manager

        scheduled: list[ScheduledChunk] = []
        pool_short = False
        index = 0
        proposals = self._propose()
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            spec = proposals.get(seq, [])[: budget - 1]
            if spec and not manager.allocate_slots(seq, num_tokens + len(spec)):
                spec = []  # no room for the proposals: decode as usual (and preempt if even that is short)
            deferred = False
            while not spec and not manager.allocate_slots(seq, num_tokens):
                pool_short = True
                if manager.num_new_blocks(seq, num_tokens) <= manager.num_free_blocks + manager.num_releasing_blocks:
                    deferred = True  # swap-outs in flight will free enough: wait for them, preempt no one
                    break
                victim = self.running.pop()  # newest admitted; never one already scheduled
                self._preempt(victim, now, out, ticket)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing newer is left to schedule
            index += 1
            if deferred:
                continue
            scheduled.append(ScheduledChunk(seq, num_tokens + len(spec), spec))
            budget -= num_tokens + len(spec)

        while self.swapped and budget > 0 and not pool_short and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not manager.swap_out_finished(seq):
                break  # its copy to the host is still running
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            pairs = manager.swap_in(seq, num_tokens, admitting=bool(self.running))
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in.extend(pairs)
            self._admit(seq, now)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens

        while (
            self.waiting
            and budget > 0
            and not pool_short
            and not self.swapped
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            cached = manager.cached_prefix(seq) if not seq.block_table else []
            num_cached_tokens = len(cached) * manager.block_size
            remaining = seq.num_tokens - seq.num_computed_tokens - num_cached_tokens
            if remaining > budget and not self.chunked_prefill:
                break
            num_tokens = min(remaining, budget)
            # the watermark guards running sequences; with none running, admit whatever fits
            if not manager.allocate_slots(seq, num_tokens, admitting=bool(self.running), cached=cached):
                break
            self.waiting.popleft()
            if manager.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached_tokens
            if seq.request.metrics.first_scheduled_time is None:
                seq.num_cached_tokens = num_cached_tokens
            self._admit(seq, now)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens

        if out.swap_out:
            out.swap_out_ticket = ticket
        for chunk in scheduled:
            if chunk.num_tokens == 1 and not chunk.seq.is_prefilling and chunk.seq.num_output_tokens:
                out.decodes.append(chunk)
            else:
                out.prefills.append(chunk)
        for chunk in out.prefills:
            if not chunk.proposals:
                chunk.seq.request.metrics.prefill_chunks.append((now, chunk.num_tokens, bool(out.decodes)))
        sampled = [chunk for chunk in out.chunks if chunk.completes_sequence]
        out.sampled_seqs = [chunk.seq for chunk in sampled]
        out.sampled_proposals = [chunk.proposals for chunk in sampled]
        return out

    def _propose(self) -> dict[Sequence, list[int]]:
        """Proposed tokens for the running sequences that decode this step (none above disable_by_batch_size;
        under a grammar, only the run it accepts), never more than their max_tokens or the context can still take."""
        spec = self.speculative
        if self.proposer is None or (
            spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size
        ):
            return {}
        max_model_len = self.stop_checker.max_model_len
        seqs, limits = [], []
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.num_output_tokens:
                continue
            if seq.num_output_tokens < seq.spec_resume_at:
                continue  # its recent proposals all missed: decode plainly for a while
            # every accepted proposal is one more output token, and the target adds one of its own
            limit = min(seq.sampling_params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return {}
        proposed = {}
        for seq, proposals in zip(seqs, self.proposer.propose(seqs, limits)):
            if proposals and seq.grammar is not None:
                proposals = proposals[: seq.grammar.valid_prefix(proposals)]
            if proposals:
                proposed[seq] = proposals
        return proposed

    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[Sequence]:
        """After the step ran: advance every chunk's computed tokens, append each sampled token to its
        sequence (`sampled` follows `out.sampled_seqs`) and finish those that stop. Returns the sequences
        that got a token. A speculating sequence's tokens follow its rows (`out.sampling_rows`)."""
        num_rows = sum(1 + len(proposals) for proposals in out.sampled_proposals)
        if len(sampled) != num_rows:
            raise ValueError(f"{len(sampled)} sampled tokens for {len(out.sampled_seqs)} sequences ({num_rows} rows)")
        for chunk in out.chunks:
            if not chunk.proposals:  # a speculating chunk's computed tokens are what verification keeps
                chunk.seq.num_computed_tokens += chunk.num_tokens
        now = time.time()
        row = 0
        advanced = []
        for seq, proposals in zip(out.sampled_seqs, out.sampled_proposals):
            tokens = sampled[row : row + 1 + len(proposals)]
            row += 1 + len(proposals)
            if not proposals:
                self._append(seq, tokens[0], now)
            elif seq.is_finished:
                continue  # aborted while its verification ran: its blocks are already back in the pool
            else:
                self._accept_proposals(seq, proposals, tokens, now)
            advanced.append(seq)
        return advanced

    def _accept_proposals(self, seq: Sequence, proposals: list[int], tokens: list[SampledToken], now: float) -> None:
        """Keep the proposals the target chose too, then the target's next token (engine/spec_decode/verify.py);
        roll the computed tokens and the block table back past the first rejected proposal."""
        accepted = num_accepted(proposals, [token.token_id for token in tokens])
        seq.num_computed_tokens += 1 + accepted  # the last token and the accepted proposals have their K/V
        # speculation that keeps missing costs k extra tokens a step for nothing: back off, doubling the pause
        seq.spec_misses = 0 if accepted else seq.spec_misses + 1
        if seq.spec_misses >= SPEC_MISSES_BEFORE_PAUSE:
            pause = min(2 ** (seq.spec_misses - SPEC_MISSES_BEFORE_PAUSE), SPEC_MAX_PAUSE_TOKENS)
            seq.spec_resume_at = seq.num_output_tokens + accepted + 1 + pause
        emitted = 0
        for token in tokens[: accepted + 1]:
            emitted += 1
            if self._append(seq, token, now):
                break  # a stop inside the accepted run: what follows is dropped
        if not seq.is_finished:
            self.block_manager.trim(seq)
        self.spec_stats.record(len(proposals), accepted, emitted)
        seq.request.metrics.spec_proposed_tokens += len(proposals)
        seq.request.metrics.spec_accepted_tokens += accepted

    def _append(self, seq: Sequence, token: SampledToken, now: float) -> bool:
        """Append one sampled token to `seq` and finish it if that token stops it; True if it finished."""
        seq.append_token(token.token_id, token.logprobs)
        if seq.request.metrics.first_token_time is None:
            seq.request.metrics.first_token_time = now
        stop = self.stop_checker.check(seq, token.token_id)
        if seq.grammar is not None:
            if not seq.grammar.accept(token.token_id):
                # the mask let only allowed tokens through: this is a bug, so end this sequence, not the engine
                logger.error("the grammar of %r refused token %d that its mask allowed", seq, token.token_id)
                stop = ("abort", None)
            elif stop is None and seq.grammar.is_terminated:
                stop = ("stop", None)
        if stop is None:
            return False
        self.finish(seq, *stop)
        return True

    def _admit(self, seq: Sequence, now: float) -> None:
        metrics = seq.request.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
        elif len(metrics.resumes) < len(metrics.preemptions):
            metrics.resumes.append(now)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence, now: float, out: SchedulerOutput, ticket: int) -> None:
        """Swap the sequence's KV to host blocks if asked and there is room, else drop it to recompute."""
        manager = self.block_manager
        out.preempted.append(seq)
        seq.request.metrics.preemptions.append(now)
        if self.preemption_mode == "swap" and manager.can_swap_out(seq):
            out.swap_out.extend(manager.swap_out(seq, ticket))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.num_preemptions_by_mode["swap"] += 1
            return
        manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions_by_mode["recompute"] += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark `seq` finished and return its blocks, wherever it is queued."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_host(seq)
        self.block_manager.free(seq)
        if self.proposer is not None:
            self.proposer.forget(seq)
        seq.finish(reason, stop_reason)
