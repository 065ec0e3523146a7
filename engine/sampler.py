"""Batched token selection: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Every transform is one tensor op over the whole batch; the only per-row Python work is drawing
noise for rows that carry their own seed (so their samples do not depend on batch composition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # chosen token and the top-n, when requested


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> list[SampledToken]:
    """logits: [num_seqs, vocab] float32 (raw, one row per sequence) -> one token per sequence."""
    params = [seq.sampling_params for seq in seqs]
    num_logprobs = [p.logprobs for p in params]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_logprobs) else None

    logits = _apply_penalties(logits, seqs)
    logits = _suppress_early_stop(logits, seqs, eos_token_ids)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.all()):
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = torch.where(greedy, logits.argmax(dim=-1), _sample_random(logits, seqs))
    token_list = token_ids.tolist()

    if raw_logprobs is None:
        return [SampledToken(t, None) for t in token_list]
    top_n = max(n or 0 for n in num_logprobs)
    top_values, top_ids = raw_logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    results = []
    for row, (token_id, n) in enumerate(zip(token_list, num_logprobs)):
        if n is None:
            results.append(SampledToken(token_id, None))
            continue
        entry = {token_id: chosen[row]}
        if n:
            entry.update(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist()))
            entry[token_id] = chosen[row]
        results.append(SampledToken(token_id, entry))
    return results


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    params = [seq.sampling_params for seq in seqs]
    if all(p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty for p in params):
        return logits
    num_seqs, vocab = logits.shape
    output_counts = torch.zeros(num_seqs, vocab)
    seen = torch.zeros(num_seqs, vocab, dtype=torch.bool)  # prompt or output
    for row, seq in enumerate(seqs):
        outputs = torch.tensor(seq.output_token_ids, dtype=torch.long)
        output_counts[row].index_add_(0, outputs, torch.ones(len(outputs)))
        seen[row, torch.tensor(seq.token_ids, dtype=torch.long)] = True
    output_counts, seen = output_counts.to(logits.device), seen.to(logits.device)
    repetition = _column([p.repetition_penalty for p in params], logits)
    presence = _column([p.presence_penalty for p in params], logits)
    frequency = _column([p.frequency_penalty for p in params], logits)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency * output_counts - presence * (output_counts > 0)


def _suppress_early_stop(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]
) -> torch.Tensor:
    """Rows still under min_tokens cannot pick EOS or a stop token id."""
    rows = [row for row, seq in enumerate(seqs) if seq.num_output_tokens < seq.sampling_params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        params = seqs[row].sampling_params
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        if stop_ids:
            logits[row, stop_ids] = float("-inf")
    return logits


def _sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    params = [seq.sampling_params for seq in seqs]
    vocab = logits.shape[-1]
    logits = logits / _column([p.temperature if p.temperature > 0 else 1.0 for p in params], logits)

    top_k = _column([p.top_k if p.top_k > 0 else vocab for p in params], logits, torch.long)
    top_p = _column([p.top_p for p in params], logits)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before > top_p  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)

    probs = torch.softmax(logits, dim=-1)
    min_p = _column([p.min_p for p in params], logits)
    if bool((min_p > 0).any()):
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)

    # Gumbel-style race: argmax(p / E) with E ~ Exp(1) draws from p.
    noise = torch.empty_like(probs).exponential_()
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[row] = torch.empty(vocab).exponential_(generator=seq.generator).to(noise.device)
    return (probs / noise).argmax(dim=-1)


def _column(values: list, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row parameters as a [num_seqs, 1] tensor on the logits' device."""
    return torch.tensor(values, dtype=dtype, device=like.device)[:, None]
