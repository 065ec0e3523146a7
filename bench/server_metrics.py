"""Speculative decoding's acceptance as the server's Prometheus /metrics shows it, scraped before and after a run.

The counters are vLLM's (`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`), which shardserve exports under its own namespace (`shardserve:`); any
namespace is read, and series are summed over their labels (replicas). A server without them, or without
/metrics, has no acceptance: nothing is reported, as `vllm bench serve` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

# counter name after the namespace -> SpecDecodeCounters field
_COUNTERS = {
    "spec_decode_num_drafts_total": "num_drafts",
    "spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
}
_SCRAPE_TIMEOUT_S = 10.0  # a server slow to show its metrics delays the run by this much at most
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


@dataclass(frozen=True)
class SpecDecodeCounters:
    """The server's totals since it started."""

    num_drafts: float = 0.0  # sequence-steps that verified proposals
    num_draft_tokens: float = 0.0  # proposed tokens
    num_accepted_tokens: float = 0.0  # proposed tokens the target model accepted


@dataclass(frozen=True)
class SpecDecodeAcceptance:
    """What one run added to the counters."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float

    @property
    def rate(self) -> float:
        """Accepted proposals over proposed ones."""
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def length(self) -> float:
        """Tokens a verifying step emits on average: the accepted proposals and the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def parse_spec_decode_counters(text: str) -> SpecDecodeCounters | None:
    """The counters in a Prometheus text exposition, summed over label sets; None when it has none of them."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or (match := _SAMPLE.match(line.strip())) is None:
            continue
        field = _COUNTERS.get(match.group(1).rpartition(":")[2])
        if field is None:
            continue
        try:
            totals[field] = totals.get(field, 0.0) + float(match.group(3))
        except ValueError:
            continue
    return SpecDecodeCounters(**totals) if totals else None


async def scrape_spec_decode_counters(http: httpx.AsyncClient, server_url: str) -> SpecDecodeCounters | None:
    """GET {server_url}/metrics (the server's root, not /v1) and read the counters; None on any failure."""
    try:
        response = await http.get(f"{server_url}/metrics", timeout=_SCRAPE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_spec_decode_counters(response.text)


def acceptance_between(
    before: SpecDecodeCounters | None, after: SpecDecodeCounters | None
) -> SpecDecodeAcceptance | None:
    """The run's acceptance, from scrapes before and after it; None if either failed or nothing was proposed."""
    if before is None or after is None or after.num_draft_tokens <= before.num_draft_tokens:
        return None
    return SpecDecodeAcceptance(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
    )
