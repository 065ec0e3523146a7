"""Two `shardserve serve` settings side by side on a machine whose speed drifts: both servers up at once, loaded
in turn (A then B, then B then A, ...), the same fresh prompts for both in each round, so a slow minute hits both
alike; the ratio per round is the figure (part of `make bench`: --cpu-threads-bind and Ray's worker niceness).

    python -m scripts.bench_served_ab --a "--cpu-threads-bind none" --b "--cpu-threads-bind 0-1"
    python -m scripts.bench_served_ab --b-env RAY_worker_niceness=0

Each load: --prompts prompts of --prompt-tokens random token ids -> 128 tokens at --concurrency, streamed, sampled
at temperature 1.0 (generated tok/s). The idle server's processes stay up during the other's load (both conditions
have them). --write-doc writes the table into docs/BENCHMARKS.md's block of this comparison (one block per --label), under
"Two server settings side by side".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import shlex
import statistics
from pathlib import Path

import httpx

from scripts.bench_serve import ServerProcess
from scripts.bench_serve_overhead import prompts, served_load
from scripts.doc_blocks import cpu_description, rewrite_block


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--a", default="", help="server A's extra flags")
    parser.add_argument("--b", default="", help="server B's extra flags")
    parser.add_argument("--a-env", default="", help="server A's extra environment, NAME=VALUE ...")
    parser.add_argument("--b-env", default="", help="server B's extra environment, NAME=VALUE ...")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=50, help="prompts per load")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--min-prompt-tokens", type=int, default=None,
                        help="prompts of lengths drawn from this to --prompt-tokens (default: all of --prompt-tokens)")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--label", default=None, help="the doc block's name (default: from the flags)")
    parser.add_argument("--write-doc", action="store_true")
    return parser.parse_args(argv)


def environment(text: str) -> dict[str, str] | None:
    return dict(pair.split("=", 1) for pair in shlex.split(text)) or None


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    """Generated tok/s of each server, per round."""
    from engine.checkpoint.random_model import ensure_bench_model

    model = args.model or str(ensure_bench_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    base = ["--dtype", args.dtype, "--max-model-len", "1024"]
    servers = {name: ServerProcess(model, extra_args=base + shlex.split(flags), env=environment(env))
               for name, flags, env in (("A", args.a, args.a_env), ("B", args.b, args.b_env))}
    rates: dict[str, list[float]] = {"A": [], "B": []}
    with contextlib.ExitStack() as stack:
        names = {}
        for name, server in servers.items():
            stack.enter_context(server.start(timeout_s=400))
            names[name] = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
            warm_up = prompts(args.concurrency, args.prompt_tokens, vocab, seed=99)
            asyncio.run(served_load(server.base_url, names[name], warm_up, 2, args.concurrency, 1.0))
        for round_index in range(args.rounds):
            # the same prompts for both in a round, new ones each round (prefix caching would skip their prefill)
            load = prompts(args.prompts, args.prompt_tokens, vocab, seed=1000 + round_index,
                           min_length=args.min_prompt_tokens)
            for name in ("AB" if round_index % 2 == 0 else "BA"):
                server = servers[name]
                rates[name].append(asyncio.run(served_load(server.base_url, names[name], load, 128,
                                                           args.concurrency, 1.0)))
            print(f"round {round_index}: A {rates['A'][-1]:.1f} B {rates['B'][-1]:.1f} tok/s, "
                  f"B/A {rates['B'][-1] / rates['A'][-1]:.3f}", flush=True)
    return rates


def lengths(args: argparse.Namespace) -> str:
    if args.min_prompt_tokens is None:
        return str(args.prompt_tokens)
    return f"{args.min_prompt_tokens}-{args.prompt_tokens}"


def describe(args: argparse.Namespace, rates: dict[str, list[float]]) -> str:
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    setting = {name: " ".join(filter(None, [env, flags])) or "defaults"
               for name, flags, env in (("A", args.a, args.a_env), ("B", args.b, args.b_env))}
    lines = [
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_description()}, bench model "
        f"({args.dtype}), {args.prompts} prompts of {lengths(args)} token ids -> 128 tokens at concurrency "
        f"{args.concurrency}, sampled, per round; A: `{setting['A']}`, B: `{setting['B']}`.",
        "",
        "| round | A tok/s | B tok/s | B / A |",
        "|---|---|---|---|",
        *(f"| {i} | {a:.1f} | {b:.1f} | {b / a:.3f} |" for i, (a, b) in enumerate(zip(rates["A"], rates["B"]))),
        f"| median | {statistics.median(rates['A']):.1f} | {statistics.median(rates['B']):.1f} | "
        f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}) |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    table = describe(args, run(args))
    print(table)
    if args.write_doc:
        label = args.label or (args.b + " " + args.b_env).strip().replace(" ", "_")
        command = "python -m scripts.bench_served_ab " + " ".join(
            f"--{name.replace('_', '-')} {shlex.quote(value)}" for name, value in
            (("a", args.a), ("b", args.b), ("a_env", args.a_env), ("b_env", args.b_env)) if value)
        if args.min_prompt_tokens is not None:
            command += f" --min-prompt-tokens {args.min_prompt_tokens} --prompt-tokens {args.prompt_tokens}"
        rewrite_block(f"<!-- served-ab:{label}:begin -->", f"<!-- served-ab:{label}:end -->",
                      f"{table}\n\nCommand: `{command}`", "Two server settings side by side")


if __name__ == "__main__":
    main()
