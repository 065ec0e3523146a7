"""Speculative decoding's cost and gain, offline (for the lead to run; not part of `make test`).

    python -m scripts.bench_spec_decode [--model PATH] [--concurrency 1 10] [--num-speculative-tokens 4]

1. The n-gram proposer's cost per step: batch 64 (and --concurrency's sizes) of sequences of 512 and 2048
   tokens, each step appending one token, as the scheduler calls it.
2. An input-grounded load: the model (default: the demo model, SmolLM2-135M-Instruct) is asked, through its
   chat template, to repeat or lightly edit a passage of Python source of about --prompt-tokens tokens (the
   prompts of `shardserve bench --dataset-name grounded`, bench/grounded.py); greedy, --output-tokens each (or,
   with --output-range-ratio r, a length of its own from --output-tokens x [1 - r, 1 + r]: requests that start
   together then end apart, with speculation or without).
   For each concurrency (--num-prompts requests, default 3 per unit of concurrency, with at most that many in
   flight at once: each finished one is replaced at once, as `vllm bench serve --max-concurrency` does)
   speculation off, then n-gram, then (with --draft-model, or --draft-layers N: the model's own first N
   layers) a draft model: TPOT (decode time per token after the first, the mean over requests), throughput
   and the acceptance seen.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.grounded import GroundedPromptBuilder


def proposer_cost_us(batch: int, length: int, steps: int = 200, k: int = 4) -> float:
    """Median microseconds of one propose() over `batch` growing sequences of `length` tokens."""
    from engine.config import SamplingParams
    from engine.sequence import Request
    from engine.spec_decode.ngram import NgramProposer

    rng = random.Random(0)
    seqs = [Request(str(i), None, [rng.randrange(32000) for _ in range(length)], SamplingParams()).seqs[0]
            for i in range(batch)]
    proposer = NgramProposer(k, 1, 3)
    times = []
    for _ in range(steps):
        for seq in seqs:
            seq.append_token(rng.randrange(32000), None)
        start = time.perf_counter()
        proposer.propose(seqs, [k] * batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def grounded_prompts(tokenizer, num: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """The token ids of `num` grounded chat prompts (`shardserve bench --dataset-name grounded`'s, for --seed)."""
    builder = GroundedPromptBuilder(tokenizer, prompt_tokens, endpoint="chat", seed=seed)
    return [builder.token_ids(message) for message in builder.build(num)]


def output_lengths(num: int, output_tokens: int, range_ratio: float, seed: int = 0) -> list[int]:
    """Each request's output length: `output_tokens`, or with a range ratio r drawn uniformly from
    [output_tokens * (1 - r), output_tokens * (1 + r)] (vLLM's --random-range-ratio), the same for a seed."""
    rng = random.Random(seed)
    low, high = round(output_tokens * (1 - range_ratio)), round(output_tokens * (1 + range_ratio))
    return [rng.randint(max(1, low), max(1, high)) for _ in range(num)]


def run_load(model: str, prompts, concurrency: int, lengths: list[int], speculative: dict | None) -> dict:
    """All `prompts` through one engine with at most `concurrency` in flight: a new one is added as soon as one
    finishes, as a load-test client at that concurrency does (a closed batch would end with the slowest
    request alone, which measures that request, not the concurrency). `lengths`: each request's output tokens."""
    from engine import LLM, SamplingParams
    from engine.outputs import RequestOutput

    llm = LLM(model=model, speculative_config=speculative, enable_prefix_caching=False)
    engine = llm.engine
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    results: dict[str, RequestOutput] = {}
    pending = list(enumerate(prompts))
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            index, prompt = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=lengths[index], ignore_eos=True)
            request = engine.add_request(str(index), prompt, params)
            results[str(index)] = RequestOutput(str(index), None, request.prompt_token_ids, [], finished=False)
            in_flight += 1
        for delta in engine.step():
            results[delta.request_id].merge(delta)
            if delta.finished:
                in_flight -= 1
    elapsed = time.perf_counter() - start
    outputs = [results[str(i)] for i in range(len(prompts))]
    tpots = []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if n > 1:
            tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    spec = engine.stats().speculation
    llm.shutdown()
    return dict(tpot_ms=1e3 * statistics.mean(tpots), tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outputs)
                / elapsed, acceptance=spec.acceptance_rate if spec else None,
                mean_accepted=(spec.num_accepted_tokens / spec.num_verifications) if spec and spec.num_verifications
                else None, tokens=[o.outputs[0].token_ids for o in outputs])


def truncated_draft(model: str, num_layers: int) -> str:
    """A draft of `model`'s first `num_layers` layers (its embeddings, final norm, LM head and tokenizer kept: the
    same vocabulary), written once into the cache folder. A layer-truncated draft of a random-weight model accepts
    about what chance gives, so with it the draft path's figure is its cost, as the issue asks."""
    import json
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from engine.checkpoint.cache_dir import cache_root

    source = Path(model)
    out = cache_root() / f"draft-{source.name}-{num_layers}-layers"
    if (out / "model.safetensors").is_file():
        return str(out)
    config = json.loads((source / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers {num_layers}: the model has {config['num_hidden_layers']} layers")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weights = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < num_layers:
                weights[name] = tensor
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    tmp.rename(out)
    return str(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the demo model)")
    parser.add_argument("--bench-model", action="store_true",
                        help="the random-weight bench model (made once in the cache folder) instead of --model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--output-range-ratio", type=float, default=0.0,
                        help="output lengths drawn from output-tokens x [1 - r, 1 + r] (vLLM's --random-range-ratio); "
                             "0: every request --output-tokens, so requests started together end together")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per concurrency (default 3x it)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="default: as vLLM, equal to the max")
    parser.add_argument("--draft-model", default=None, help="also measure method draft_model with this model")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="also measure method draft_model with the model's first N layers as the draft "
                             "(a Hugging Face directory model; written once into the cache folder)")
    parser.add_argument("--skip-load", action="store_true", help="only the proposer's cost")
    args = parser.parse_args(argv)

    print("| batch | tokens per sequence | n-gram proposer per step (µs) |\n|---|---|---|")
    for batch in sorted({64, *args.concurrency}):
        for length in (512, 2048):
            print(f"| {batch} | {length} | {proposer_cost_us(batch, length):.0f} |")
    if args.skip_load:
        return

    from engine.checkpoint.demo import ensure_demo_model
    from engine.checkpoint.loader import load_tokenizer

    if args.bench_model:
        from engine.checkpoint.random_model import ensure_bench_model

        model = str(ensure_bench_model())
    else:
        model = args.model or str(ensure_demo_model())
    tokenizer = load_tokenizer(model)
    methods = {"ngram": {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                         "prompt_lookup_max": args.prompt_lookup_max,
                         **({"prompt_lookup_min": args.prompt_lookup_min} if args.prompt_lookup_min else {})}}
    draft = args.draft_model or (truncated_draft(model, args.draft_layers) if args.draft_layers else None)
    if draft:
        methods["draft"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.num_speculative_tokens}
    print("\n| concurrency | speculation | TPOT (ms) | tokens/s | acceptance | accepted per step |\n|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        prompts = grounded_prompts(tokenizer, args.num_prompts or 3 * concurrency, args.prompt_tokens)
        lengths = output_lengths(len(prompts), args.output_tokens, args.output_range_ratio)
        off = run_load(model, prompts, concurrency, lengths, None)
        print(f"| {concurrency} | off | {off['tpot_ms']:.1f} | {off['tokens_per_s']:.1f} | | |")
        for name, speculative in methods.items():
            on = run_load(model, prompts, concurrency, lengths, speculative)
            same = "" if on["tokens"] == off["tokens"] else " (outputs differ: near-ties?)"
            acceptance, accepted = (f"{on[key]:.2f}" if on[key] is not None else "no verification"
                                    for key in ("acceptance", "mean_accepted"))
            print(f"| {concurrency} | {name} k={args.num_speculative_tokens} | {on['tpot_ms']:.1f} | "
                  f"{on['tokens_per_s']:.1f} | {acceptance} | {accepted}{same} |")
            print(f"|  | {name} / off | {on['tpot_ms'] / off['tpot_ms']:.2f}x | "
                  f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x | | |")


if __name__ == "__main__":
    main()
