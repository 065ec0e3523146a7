"""n-gram prompt lookup: propose what followed the latest earlier occurrence of a sequence's last n tokens.

For every sequence the longest n in [prompt_lookup_min, prompt_lookup_max] whose suffix occurs earlier in
its own prompt+output wins; among the occurrences of that n-gram the latest is taken, and the tokens after
it are proposed. The search is numpy over the whole batch at once: the sequences' tokens (kept per sequence
in growing int32 buffers, so a step copies only the new tokens) are right-aligned in one matrix, the
positions equal to the last token are found in one comparison, and only those candidates are extended.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import numpy as np

from engine.sequence import Sequence

_PAD = -1  # no token id: padding never matches


class _TokenBuffer:
    """A sequence's token ids as a growing int32 array (tokens are only ever appended)."""

    def __init__(self):
        self.array = np.empty(256, dtype=np.int32)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array view of `token_ids`, copying only the tokens appended since the last call."""
        n = len(token_ids)
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int32)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length : n] = token_ids[self.length : n]
        self.length = n
        return self.array[:n]


class Proposer(Protocol):
    """What the scheduler asks of a proposer (this n-gram one, or engine/spec_decode/draft.py's model)."""

    def propose(self, seqs: list[Sequence], max_proposals: list[int]) -> list[list[int]]: ...

    def forget(self, seq: Sequence) -> None: ...


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: weakref.WeakKeyDictionary[Sequence, _TokenBuffer] = weakref.WeakKeyDictionary()

    def forget(self, seq: Sequence) -> None:
        """`seq` finished: drop its token buffer."""
        self._buffers.pop(seq, None)

    def propose(self, seqs: list[Sequence], max_proposals: list[int]) -> list[list[int]]:
        """Up to min(k, max_proposals[i]) proposed tokens for each sequence (an empty list: no match)."""
        arrays = []
        for seq in seqs:
            buffer = self._buffers.get(seq)
            if buffer is None:
                buffer = self._buffers[seq] = _TokenBuffer()
            arrays.append(buffer.sync(seq.token_ids))
        return propose_ngram(arrays, [min(self.k, m) for m in max_proposals], self.min_n, self.max_n)


def propose_ngram(token_arrays: list[np.ndarray], num_proposals: list[int], min_n: int, max_n: int) -> list[list[int]]:
    """The proposals for each token array (int32, one per sequence), at most num_proposals[i] tokens each."""
    proposals: list[list[int]] = [[] for _ in token_arrays]
    rows = [i for i, (a, k) in enumerate(zip(token_arrays, num_proposals)) if k > 0 and len(a) > min_n]
    if not rows:
        return proposals
    width = max(len(token_arrays[i]) for i in rows)
    tokens = np.full((len(rows), width), _PAD, dtype=np.int32)  # [seqs, width], right-aligned
    for row, i in enumerate(rows):
        a = token_arrays[i]
        tokens[row, width - len(a) :] = a
    # a candidate is an earlier position `end` whose token equals the last one: the n-gram ending there
    # matches the suffix for as many tokens as agree going backwards, and what follows `end` is proposed
    # (flatnonzero of the whole matrix: a 2-D nonzero costs ten times as much)
    hits = np.flatnonzero(tokens == tokens[:, -1:])
    cand_row, cand_end = hits // width, hits % width
    keep = cand_end < width - 1  # the last token itself is no earlier occurrence
    cand_row, cand_end = cand_row[keep], cand_end[keep]
    if len(cand_row) == 0:
        return proposals
    match_len = np.ones(len(cand_row), dtype=np.int32)
    alive = np.ones(len(cand_row), dtype=bool)
    for back in range(1, max_n):
        ok = cand_end - back >= 0
        left = np.where(ok, tokens[cand_row, np.maximum(cand_end - back, 0)], _PAD)
        alive &= ok & (left == tokens[cand_row, width - 1 - back]) & (left != _PAD)
        match_len += alive
    eligible = match_len >= min_n
    # the longest match wins, then the latest: one score, the maximum per row
    score = np.where(eligible, np.minimum(match_len, max_n).astype(np.int64) * (width + 1) + cand_end, -1)
    best = np.full(len(rows), -1, dtype=np.int64)
    np.maximum.at(best, cand_row, score)
    for row, i in enumerate(rows):
        if best[row] < 0:
            continue
        end = int(best[row] % (width + 1))
        start = end + 1
        stop = min(start + num_proposals[i], width)
        proposals[i] = tokens[row, start:stop].tolist()
    return proposals
