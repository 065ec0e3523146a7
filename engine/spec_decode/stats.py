"""Counters of speculative decoding, kept by the scheduler and read by EngineStats and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    num_speculative_tokens: int  # k: acceptance lengths run from 0 to k
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verifying steps added (accepted ones plus the target's own)
    num_verifications: int = 0  # sequence-steps that verified proposals
    # acceptance_length_counts[n]: verifications that accepted n proposals
    acceptance_length_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.acceptance_length_counts:
            self.acceptance_length_counts = [0] * (self.num_speculative_tokens + 1)

    def record(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        """One sequence's verification in one step."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        self.num_verifications += 1
        self.acceptance_length_counts[num_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals over proposed ones (0 before any)."""
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0
