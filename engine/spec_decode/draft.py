"""Draft-model proposals: a second, smaller model with the target's vocabulary proposes greedily.

The draft runs in the engine's process (rank 0's, under tensor parallelism: it is never sharded), on its own
`ModelRunner` with its own paged KV cache and `BlockManager`: as many blocks as the target holds (of the
draft's size, so a fraction of the target's bytes) plus one per sequence for the proposals' slots. Each step
it catches up on the tokens it has not computed (the target's accepted tokens and its own after a rollback),
then proposes k tokens by k-1 more one-token passes, batched over the sequences. Its proposals are its argmax,
a point mass, so verification (verify.py) stays exact. Its K/V for rejected proposals is rolled back by
counting how many of them the target kept.
"""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner, prepare_step
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence


class DraftVocabularyError(ValueError):
    """The draft model's vocabulary is not the target's: its token ids would mean other tokens."""


class _DraftSequence:
    """A sequence as the draft sees it: the target's tokens plus this step's proposals so far."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.proposals: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_registered_blocks = 0  # (the draft's block manager caches no prefixes)
        self.base_len = 0  # the target's token count when the last proposals were made

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.proposals if self.proposals else self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.proposals)

    def roll_back(self) -> None:
        """Forget the K/V of proposals the target did not keep (it may have kept all, then added one)."""
        kept = 0
        for proposed, actual in zip(self.proposals, self.seq.token_ids[self.base_len :]):
            if proposed != actual:
                break
            kept += 1
        # the last token is always computed again: its logits give the first proposal
        self.num_computed_tokens = min(self.num_computed_tokens, self.base_len + kept, self.seq.num_tokens - 1)
        self.proposals = []


def check_draft_vocabulary(draft: ModelConfig, target: ModelConfig, draft_tokenizer, target_tokenizer) -> None:
    """Refuse a draft whose vocabulary differs from the target's (size or token strings)."""
    if draft.vocab_size != target.vocab_size:
        raise DraftVocabularyError(
            f"the draft model has a vocabulary of {draft.vocab_size} tokens, the target {target.vocab_size}: "
            "speculative_config.model must use the target's tokenizer"
        )
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise DraftVocabularyError(
            "the draft model's tokenizer maps tokens to other ids than the target's: "
            "speculative_config.model must use the target's tokenizer"
        )


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft_model_config: ModelConfig, num_blocks: int, max_model_len: int):
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        draft_config = config.model_copy(update=dict(
            model=spec.model, tokenizer=None, tensor_parallel_size=1, speculative_config=None,
            num_kv_blocks=num_blocks, kv_cache_memory_gb=None, preemption_mode="recompute",
            enable_prefix_caching=False, cpu_threads=config.resolved_cpu_threads(),  # rank 0's share of the cores
        ))
        self.runner = ModelRunner(draft_config, draft_model_config, num_blocks=num_blocks, max_model_len=max_model_len)
        self.block_size = config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, watermark=0.0)
        # each running sequence's draft state, until the scheduler reports it finished (`forget`)
        self._states: dict[Sequence, _DraftSequence] = {}

    def forget(self, seq: Sequence) -> None:
        """`seq` finished: its draft blocks go back to the draft's pool."""
        state = self._states.pop(seq, None)
        if state is not None:
            self.block_manager.free(state)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_proposals: list[int]) -> list[list[int]]:
        """Up to min(k, max_proposals[i]) greedy draft tokens for each sequence."""
        states, wanted = [], []
        for seq, limit in zip(seqs, max_proposals):
            state = self._states.get(seq)
            if state is None:
                state = self._states[seq] = _DraftSequence(seq)
            state.roll_back()
            state.base_len = seq.num_tokens
            states.append(state)
            wanted.append(min(self.k, limit))
        active = [i for i in range(len(states)) if wanted[i] > 0]
        while active:
            chunks = []
            for i in list(active):
                state = states[i]
                num_tokens = state.num_tokens - state.num_computed_tokens
                if not self.block_manager.allocate_slots(state, num_tokens):
                    self.forget(state.seq)  # the draft's pool is short: no proposals, recomputed later
                    states[i].proposals = []
                    active.remove(i)
                    continue
                chunks.append(ScheduledChunk(state, num_tokens))
            if not chunks:
                break
            step = prepare_step(SchedulerOutput(prefills=chunks), self.block_size)
            next_tokens = self.runner.compute_logits(step).argmax(dim=-1).tolist()
            for chunk, token in zip(chunks, next_tokens):
                chunk.seq.num_computed_tokens += chunk.num_tokens
                chunk.seq.proposals.append(token)
            active = [i for i in active if len(states[i].proposals) < wanted[i]]
        return [state.proposals[:n] for state, n in zip(states, wanted)]

    def shutdown(self) -> None:
        self.runner.shutdown()
