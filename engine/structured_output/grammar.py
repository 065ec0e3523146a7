"""One sequence's place in its grammar, and a step's bitmask over the constrained sequences it samples.

The matcher advances in `Scheduler.update_from_output` on each accepted token, so it always stands
after the sequence's last output token: preemption (recompute or swap) and prefix-cache hits touch
only KV blocks, never the tokens, and need no rollback. n > 1 gives each sequence its own matcher.
"""

from __future__ import annotations

import weakref
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

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


@dataclass
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows: `bitmask[i]` masks logits row `rows[i]`."""

    rows: torch.Tensor  # [num_masked] int64, rows of the step's sampled logits
    bitmask: torch.Tensor  # [num_masked, ceil(vocab / 32)] int32 (kernels/bitmask.py)


def fill_bitmask(grammars: list[tuple[int, SequenceGrammar]], vocab_size: int) -> GrammarBitmask:
    """The bitmask of (logits row, grammar) pairs, one matcher call per row."""
    bitmask = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i, (_, grammar) in enumerate(grammars):
        grammar.fill(bitmask, i)
    return GrammarBitmask(torch.tensor([row for row, _ in grammars], dtype=torch.int64), bitmask)
