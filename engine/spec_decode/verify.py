"""Verification of proposed tokens: one sampled row per position of a speculating chunk, and acceptance.

A speculating sequence with proposals d_1..d_k is computed as k+1 query tokens (its last token, then the
proposals). Row j (0..k) is sampled as the sequence would be had d_1..d_j been accepted: its penalties see
them among the outputs, min_tokens counts them, and its draw uses the counter of the token it picks (the
output position), so the sampler needs nothing new (`SpeculativeRow` is what it reads of a sequence).

Acceptance keeps t_0 and then t_{j} while d_j == t_{j-1}: the longest run of proposals equal to the
target's own choices, plus the target's token after it. In greedy mode t_j is the argmax. When sampling,
t_j is an exact draw from the target's processed distribution p_j (temperature, top-k/top-p/min-p,
penalties, logit_bias), which is rejection sampling (Leviathan et al. 2023) for a draft that is a point
mass on d_j: d_j is accepted with probability p_j(d_j) = min(1, p_j(d_j) / 1), and a rejection emits a
token drawn from p_j without d_j, renormalised, i.e. max(0, p_j - q_j). Each emitted token therefore has
the target's distribution, and a seeded request picks the same tokens with or without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SamplingParams
from engine.sequence import Sequence


@dataclass
class SpeculativeRow:
    """What the sampler reads of a sequence, one position on: as if `proposals` were already accepted."""

    seq: Sequence
    proposals: list[int]  # the proposals before this row's position

    @property
    def grammar(self):  # the sequence's matcher: the row is masked as it stands after `proposals`
        return self.seq.grammar

    @property
    def sampling_params(self) -> SamplingParams:
        return self.seq.sampling_params

    @property
    def sampling_seed(self) -> int:
        return self.seq.sampling_seed

    @property
    def token_ids(self) -> list[int]:  # built only when read (penalties): a copy per row
        return self.seq.token_ids + self.proposals

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.proposals

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.proposals)


def sampling_rows(seq: Sequence, proposals: list[int]) -> list[Sequence | SpeculativeRow]:
    """The rows to sample for `seq`: itself, then one per proposal as if the proposals before it were accepted."""
    return [seq] + [SpeculativeRow(seq, proposals[:j]) for j in range(1, len(proposals) + 1)]


def num_accepted(proposals: list[int], target_tokens: list[int]) -> int:
    """How many leading proposals equal the target's choice at their position (target_tokens has one more)."""
    accepted = 0
    for proposed, chosen in zip(proposals, target_tokens):
        if proposed != chosen:
            break
        accepted += 1
    return accepted
