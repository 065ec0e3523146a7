"""One sequence's place in its grammar, and a step's bitmask over the constrained sequences it samples.

The matcher advances in `Scheduler.update_from_output` on each accepted token, so it always stands
after the sequence's last output token: preemption (recompute or swap) and prefix-cache hits touch
only KV blocks, never the tokens, and need no rollback. n > 1 gives each sequence its own matcher.

Speculative decoding walks it ahead and back between steps: the proposals are cut to the longest run the
grammar accepts (`valid_prefix`), and the row of a speculating chunk that stands after proposals d_1..d_j is
masked as the matcher would be after them (`fill_bitmask` accepts them, fills, and rolls them back), so each
verified position samples from the distribution the same position has without speculation.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from kernels.bitmask import bitmask_words

# Every SequenceGrammar alive: tests check that finished and aborted requests leave none behind.
_live: weakref.WeakSet = weakref.WeakSet()


def num_live_matchers() -> int:
    return len(_live)


class SequenceGrammar:
    """An xgrammar matcher over one sequence's output tokens."""

    def __init__(self, compiled_grammar):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled_grammar)
        _live.add(self)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar forbids it (the mask should have made that impossible)."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a complete output and its stop token: the sequence ends ("stop")."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, after: SequenceABC[int] = ()) -> None:
        """Fill `bitmask[row]` with the tokens allowed next; after `after` (a verified row's proposals, all
        accepted by valid_prefix) when given, the matcher standing where it stood before."""
        for accepted, token_id in enumerate(after):
            if not self._matcher.accept_token(token_id):
                if accepted:
                    self._matcher.rollback(accepted)
                raise ValueError(f"proposal {token_id} is not in the grammar (valid_prefix cuts such runs)")
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if after:
            self._matcher.rollback(len(after))

    def valid_prefix(self, proposals: SequenceABC[int]) -> int:
        """How many leading proposals the grammar accepts, stopping before one that would end it (a row after
        the end has no tokens to allow); the matcher is left where it stood."""
        accepted = 0
        for token_id in proposals:
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                accepted -= 1
                break
        if accepted:
            self._matcher.rollback(accepted)
        return accepted


@dataclass
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows: `bitmask[i]` masks logits row `rows[i]`."""

    rows: torch.Tensor  # [num_masked] int64, rows of the step's sampled logits
    bitmask: torch.Tensor  # [num_masked, ceil(vocab / 32)] int32 (kernels/bitmask.py)


def fill_bitmask(grammars: list[tuple[int, SequenceGrammar, SequenceABC[int]]], vocab_size: int) -> GrammarBitmask:
    """The bitmask of (logits row, grammar, proposals before the row) triples, one matcher fill per row."""
    bitmask = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i, (_, grammar, after) in enumerate(grammars):
        grammar.fill(bitmask, i, after)
    return GrammarBitmask(torch.tensor([row for row, _, _ in grammars], dtype=torch.int64), bitmask)
