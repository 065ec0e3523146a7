"""Token selection from logits: temperature, top-k, top-p, min-p and the draw, one row per sequence.

Every backend implements `sample_tokens_torch`'s contract:

- a row with temperature 0 takes the argmax (the first index among equal maxima, as torch.argmax);
- otherwise the kept set is the tokens whose logit is at least every threshold:
  top-k: the k-th largest logit (ties with it stay, so a row may keep more than k);
  top-p: the largest logit v such that the tokens at or above v hold at least top_p of the top-k
  set's probability mass (the smallest head of the sorted distribution that reaches top_p, plus ties);
  min-p: probability at least min_p times the largest;
- the draw is inverse-transform sampling over the kept tokens in vocabulary order: the first token
  whose running probability mass (float64) passes `uniform * total`. One uniform per row, from a
  counter-based hash (`counter_uniforms`), so a row's draw depends on its seed and position only.

Why not Gumbel-max with noise per vocabulary entry: that needs a hash and two logarithms for each of
the V entries of each row (V = 32,000 to 152,064), which on CPU costs more than the rest of the
sampler; one uniform per row draws from exactly the same distribution, and its reproducibility is the
same (a pure function of seed and position, no generator state).
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO_TO_MINUS_53 = 2.0**-53


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def sequence_seed(request_seed: int, index: int) -> int:
    """The stream of choice `index` of a request with `request_seed` (n > 1 gives n distinct streams)."""
    with np.errstate(over="ignore"):
        seed = np.array([request_seed % 2**64], dtype=np.uint64)
        return int(_splitmix64(seed + np.array([index], dtype=np.uint64) * _GOLDEN)[0])


def counter_uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[num_rows] float64 in (0, 1): the position-th output of the SplitMix64 stream with that seed.

    A pure function of (seed, position): the same request draws the same token alone, in any batch,
    after a prefix-cache hit or a preemption."""
    with np.errstate(over="ignore"):
        seed = np.asarray(seeds, dtype=np.uint64)
        position = np.asarray(positions, dtype=np.uint64)
        bits = _splitmix64(_splitmix64(seed) + (position + np.uint64(1)) * _GOLDEN)
    return torch.from_numpy(((bits >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_TO_MINUS_53)


def sample_tokens_torch(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy
    top_k: torch.Tensor,  # [num_rows] int32; <= 0 or >= vocab = off
    top_p: torch.Tensor,  # [num_rows] float32 in (0, 1]
    min_p: torch.Tensor,  # [num_rows] float32 in [0, 1]
    uniforms: torch.Tensor,  # [num_rows] float64 in (0, 1)
) -> torch.Tensor:
    """[num_rows] int64 token ids (the reference: sorts, float64 sums)."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64)
    for row in range(num_rows):
        x = logits[row].float()
        temp = float(temperature[row])
        if temp == 0.0:
            out[row] = int(x.argmax())
            continue
        m = x.max()
        keep = torch.ones(vocab, dtype=torch.bool, device=x.device)
        k = int(top_k[row])
        if 0 < k < vocab:
            keep &= x >= x.topk(k).values[-1]
        e = torch.where(keep, torch.exp((x - m) * (1.0 / temp)), 0.0)
        p = float(top_p[row])
        if p < 1.0:
            sorted_x, order = x.masked_fill(~keep, float("-inf")).sort(descending=True)
            mass = e[order].double().cumsum(0)
            first_enough = int(torch.searchsorted(mass, p * float(mass[-1])))
            keep &= x >= sorted_x[min(first_enough, vocab - 1)]
        if float(min_p[row]) > 0.0:
            keep &= e >= float(min_p[row])
        e = torch.where(keep, e, 0.0).double()
        cumulative = e.cumsum(0)
        target = float(uniforms[row]) * float(cumulative[-1])
        chosen = int(torch.searchsorted(cumulative, target, right=True))
        if chosen >= vocab:  # rounding left the target at the very end
            chosen = int((e > 0).nonzero()[-1])
        out[row] = chosen
    return out.to(logits.device)
