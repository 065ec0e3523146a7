"""The sampler alone: the native fused op vs the torch reference, and the exponential race it replaced
(part of `make bench`).

    python -m scripts.bench_sampler [--write-doc] [--vocab 32000,152064] [--batches 1,10,50,100]

Times, on random float32 logits, for each vocabulary and batch size:
- `sample()`: the engine's whole sampler (engine/sampler.py: parameter tensors, counter-based
  uniforms, the native op), at temperature 1.0 as vLLM's client leaves it;
- the native op alone (kernels/cpu/sampling.cpp), at temperature 1.0 and with top-k 50 + top-p 0.9;
- the torch reference (kernels/sampling.py), the same two ways;
- the sampler before the fused op: softmax, `exponential_()` noise over the batch, argmax.
Median of --repeats rounds, each the mean of --calls calls, the implementations alternated.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from engine.config import SamplingParams
from engine.sampler import sample
from engine.sequence import Request
from kernels.backend import TORCH, get_backend
from kernels.sampling import counter_uniforms
from scripts.bench_cpu_kernels import timed
from scripts.doc_blocks import rewrite_block, timing_body

BEGIN, END = "<!-- sampler:begin -->", "<!-- sampler:end -->"
COLUMNS = [
    "sample(), T=1",
    "native op, T=1",
    "native op, top-k 50 + top-p 0.9",
    "reference, T=1",
    "reference, top-k 50 + top-p 0.9",
    "exponential race (before), T=1",
]


def exponential_race(logits: torch.Tensor) -> torch.Tensor:
    """What engine/sampler.py did before the fused op, at temperature 1 without filters."""
    probs = torch.softmax(logits, dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def calls_for(batch: int, vocab: int, generator: torch.Generator) -> list:
    """One callable per column, on the same logits."""
    native = get_backend("cpu", "cpu")
    logits = torch.randn(batch, vocab, generator=generator) * 2
    ones, zeros = torch.ones(batch), torch.zeros(batch)
    no_k, top_k = torch.zeros(batch, dtype=torch.int32), torch.full((batch,), 50, dtype=torch.int32)
    top_p = torch.full((batch,), 0.9)
    uniforms = counter_uniforms(list(range(batch)), [0] * batch)
    plain = (logits, ones, no_k, ones, zeros, uniforms)
    filtered = (logits, ones, top_k, top_p, zeros, uniforms)
    seqs = [Request(str(i), None, [1, 2, 3], SamplingParams(temperature=1.0)).seqs[0] for i in range(batch)]
    return [
        lambda: sample(logits, seqs, (), native),
        lambda: native.sample_tokens(*plain),
        lambda: native.sample_tokens(*filtered),
        lambda: TORCH.sample_tokens(*plain),
        lambda: TORCH.sample_tokens(*filtered),
        lambda: exponential_race(logits),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="32000,152064")
    parser.add_argument("--batches", default="1,10,50,100")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            fns = calls_for(batch, vocab, generator)
            for fn in fns:
                fn()  # warm-up (and the extension's build, the first time)
            samples: list[list[float]] = [[] for _ in fns]
            for _ in range(args.repeats):
                for times, fn in zip(samples, fns):
                    times.append(timed(fn, args.calls))
            medians = [statistics.median(times) for times in samples]
            rows.append(f"| {batch} × {vocab} | " + " | ".join(f"{ms:.3f}" for ms in medians) + " |")
            print(rows[-1], flush=True)
    body = timing_body(
        "float32 logits, milliseconds",
        ["batch × vocab", *COLUMNS],
        rows,
        args.repeats,
        args.calls,
        "python -m scripts.bench_sampler --write-doc",
    )
    if args.write_doc:
        rewrite_block(BEGIN, END, body, "Sampler")


if __name__ == "__main__":
    main()
