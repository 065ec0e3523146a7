"""The structured-output mask: tokens a grammar forbids get logit -inf before anything samples them.

Every backend implements `apply_token_bitmask_torch`'s contract. The bitmask is xgrammar's layout: row i
is int32 words, bit j of word w set when token 32 * w + j is allowed (`ceil(vocab / 32)` words a row).
Only the constrained rows have a bitmask row; `rows` names which logits row each one masks. The mask
goes in place, after penalties and logit_bias and before temperature, top-k/top-p/min-p and the draw
(engine/sampler.py), so greedy and sampled rows alike only ever pick an allowed token.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a bitmask over `vocab_size` tokens."""
    return -(-vocab_size // BITS_PER_WORD)


def apply_token_bitmask_torch(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    bitmask: torch.Tensor,  # [num_masked, ceil(vocab / 32)] int32
    rows: torch.Tensor,  # [num_masked] int64: the logits row each bitmask row masks
) -> None:
    """Set logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear (the reference)."""
    vocab = logits.shape[1]
    if rows.numel() == 0:
        return
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.to(torch.int32)[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [masked, vocab]
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
