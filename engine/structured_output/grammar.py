"""One sequence's place in its grammar, and a step's bitmask over the constrained sequences it samples.

The matcher advances in `Scheduler.update_from_output` on each accepted token, so it always stands
after the sequence's last output token: preemption (recompute or swap) and prefix-cache hits touch
only KV blocks, never the tokens, and need no rollback. n > 1 gives each sequence its own matcher.

Speculative decoding walks it ahead and back between steps: the proposals are cut to the longest run the
grammar accepts (`valid_prefix`), and the row of a speculating chunk that stands after proposals d_1..d_j is
masked as the matcher would be after them (`fill_bitmask` accepts them, fills, and rolls them back), so each
verified position samples from the distribution the same position has without speculation.

A row after a proposal the grammar refuses (or one that would end it) cannot be masked that way: there is no
such position. The scheduler's `valid_prefix` cut means this never happens, and if a proposer slipped past it,
it would still do no harm. The row is masked as the matcher stands before that proposal. The row before a
refused proposal forbids it, so the target never accepts it; a proposal that ends the grammar ends the sequence
when accepted. Either way no row after it is ever emitted, so the sequence and the rest of the step go on.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from kernels.bitmask import bitmask_words

logger = logging.getLogger("shardserve.engine")

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
        """Fill `bitmask[row]` with the tokens allowed next; after `after` (a verified row's proposals) when
        given, the matcher standing where it stood before. Proposals past valid_prefix's run are not followed
        (the module docstring says why that row is never emitted)."""
        followed = self._advance(after)
        if followed < len(after):
            logger.error("proposal %d is outside the grammar or ends it (valid_prefix cuts such runs): the verified "
                         "row after it is masked as before it, and is never emitted", after[followed])
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if followed:
            self._matcher.rollback(followed)

    def valid_prefix(self, proposals: SequenceABC[int]) -> int:
        """How many leading proposals the grammar accepts, stopping before one that would end it (a row after
        the end has no tokens to allow); the matcher is left where it stood."""
        accepted = self._advance(proposals)
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def _advance(self, proposals: SequenceABC[int]) -> int:
        """Accept the leading proposals the grammar accepts, stopping before one that would end it; how many."""
        accepted = 0
        for token_id in proposals:
            if not self._matcher.accept_token(token_id):
                break
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                break
            accepted += 1
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
