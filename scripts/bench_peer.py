"""shardserve side by side with vLLM's CPU build, as users measure (part of `make bench`).

    python -m scripts.bench_peer --vllm-python PEER/venv/bin/python [--write-doc]

In one run, on the bench model and the same machine:
- offline: 64 prompts × 512 random token ids → 128 tokens (ignore_eos), greedy and at temperature 1.0,
  vLLM's `LLM.generate` (in its venv) and shardserve's `LLM.generate`;
- served: vLLM's server first, then `shardserve serve`, each loaded by **both** clients, vLLM's own
  `vllm bench serve` (random dataset, `--ignore-eos`) and `shardserve bench`, sampled (no temperature
  sent: each server's default 1.0, as vLLM's client leaves it) and greedy (`--temperature 0`), at
  concurrency 1/10/50/100.
Writes the comparison table to docs/BENCHMARKS.md ("Side by side with vLLM") with the date and commit.
`--dataset-name grounded` serves the input-grounded load instead of the random one (bench/grounded.py): each run's
prompts are written as JSONL first, and vLLM's client sends them as its custom dataset while `shardserve bench`
sends the same ones; `--speculative-config JSON` starts both servers with it; `--extra-body JSON` is merged into
every request by both clients (a `response_format`: the structured-output load of docs/BENCHMARKS.md).
`bash scripts/setup_peer.sh` makes the peer's venv (../shared/PEER.md has the details).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.cli import json_object
from bench.run import BenchArgs, run_bench, save_dataset
from engine.checkpoint.model_config import load_model_config
from kernels.backend import cpu_supports_bf16
from scripts.bench_engine import make_prompts
from scripts.bench_serve import (
    REPO,
    VLLM_LAUNCHER,
    VLLM_VERSION_SHIM,
    ServerProcess,
    bench_model_dir,
    git_commit,
    vllm_cpu_env,
    vllm_version,
)
from scripts.doc_blocks import cpu_description, rewrite_block

BEGIN, END = "<!-- peer-bench:begin -->", "<!-- peer-bench:end -->"
REAL_BEGIN, REAL_END = "<!-- peer-bench-real:begin -->", "<!-- peer-bench-real:end -->"
MODES = {"sampled": None, "greedy": 0.0}  # temperature sent; None = not sent (the server's default)

OFFLINE_MODES = {"greedy": 0.0, "sampled": 1.0}
# The offline runs, one per engine, each in a child process reading the same arguments file: {"model",
# "dtype", "prompts": {mode: [token ids, ...]}, "output_len"}; each prints RESULT {mode: tok/s}.
_VLLM_OFFLINE = VLLM_VERSION_SHIM + f"""
import json, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
args = json.load(open(sys.argv[1]))
llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=1024, enable_prefix_caching=False)
warm_up = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]["greedy"][:2]]
llm.generate(warm_up, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
result = {{}}
for mode, temperature in {OFFLINE_MODES!r}.items():
    params = SamplingParams(temperature=temperature, max_tokens=args["output_len"], ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"][mode]]
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    result[mode] = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
print("RESULT " + json.dumps(result), flush=True)
"""
_SHARDSERVE_OFFLINE = f"""
import json, sys
from engine import LLM, SamplingParams
from scripts.bench_engine import timed_generate
args = json.load(open(sys.argv[1]))
llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=1024, enable_prefix_caching=False)
llm.generate(args["prompts"]["greedy"][:2], SamplingParams(max_tokens=4, ignore_eos=True))
result = {{m: timed_generate(llm, args["prompts"][m], args["output_len"], t) for m, t in {OFFLINE_MODES!r}.items()}}
print("RESULT " + json.dumps(result), flush=True)
"""


BENCH_MODEL_DEFAULTS = {"concurrency": "1,10,50,100", "num_prompts": "30,200,500,600", "clients": "vllm,shardserve",
                        "modes": "sampled,greedy"}
REAL_MODEL_DEFAULTS = {"concurrency": "1,10,50", "num_prompts": "30,150,300", "clients": "vllm", "modes": "sampled"}


def real_model_hf_dir(gguf_file: Path, dtype: str) -> Path:
    """The demo model's weights as a Hugging Face directory for vLLM, written once into the cache folder."""
    from engine.checkpoint.cache_dir import cache_root
    from scripts.gguf_to_hf import convert

    out = cache_root() / f"{gguf_file.stem}-hf-{dtype}"
    if not (out / "model.safetensors").is_file() or not (out / "tokenizer.json").is_file():
        convert(gguf_file, out, dtype)
    return out


def run_seed(mode: str, concurrency: int) -> int:
    """Each run's prompts differ from every other run's (both servers get the same ones): a repeated
    prompt would be a free prefix-cache hit for shardserve, whose prefix caching is on by default."""
    return 1000 * list(MODES).index(mode) + concurrency


@dataclass
class Row:
    """One load at one concurrency, one server, one client."""

    client: str
    mode: str
    concurrency: int
    server: str
    tok_s: float
    ttft_p95_ms: float
    tpot_mean_ms: float
    spec_acceptance_rate: float | None = None  # the server's speculative decoding over the run, if it speculates


def _tcmalloc(vllm_python: str) -> str | None:
    """The TCMalloc that scripts/setup_peer.sh unpacks beside the peer's venv, if it is there."""
    lib = Path(vllm_python).absolute().parent.parent.parent / "tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    return str(lib) if lib.is_file() else None


def offline_run(command: list[str], arguments: dict, env: dict[str, str], cwd) -> dict[str, float]:
    """Run an offline script (`command` + the path of a JSON file of `arguments`), with `env` on top of this
    process's environment (as ServerProcess does); its RESULT {mode: tok/s}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(arguments, f)
    try:
        done = subprocess.run([*command, f.name], env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                              timeout=1800)
    finally:
        os.unlink(f.name)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{command[0]} {command[1]}: offline run failed ({done.returncode}):\n{done.stderr[-3000:]}")


def bench_args(server: ServerProcess, tokenizer_dir: str, mode: str, concurrency: int, num_prompts: int,
               args) -> BenchArgs:
    """`shardserve bench`'s settings for one run (and, for the grounded dataset, those of vLLM's run's prompts)."""
    return BenchArgs(
        base_url=server.base_url, tokenizer=tokenizer_dir, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, concurrency=[concurrency], num_prompts=[num_prompts], warmup=2,
        temperature=MODES[mode], progress=False, seed=run_seed(mode, concurrency), dataset_name=args.dataset_name,
        extra_body=args.extra_body,
    )


def vllm_dataset_flags(settings: BenchArgs, out_dir: str) -> list[str]:
    """`vllm bench serve`'s prompt flags: its own random dataset, or the grounded prompts `shardserve bench`
    sends with these settings, written into out_dir as its custom dataset (chat template applied by vLLM)."""
    if settings.dataset_name == "random":
        return ["--dataset-name", "random", "--random-input-len", str(settings.prompt_tokens),
                "--random-output-len", str(settings.output_tokens)]
    path = str(Path(out_dir) / "grounded.jsonl")
    save_dataset(settings, path)
    return ["--dataset-name", "custom", "--dataset-path", path, "--custom-output-len", str(settings.output_tokens),
            "--disable-shuffle"]


def check_custom_dataset_support(vllm_python: str) -> None:
    """vLLM's custom dataset reads its JSONL with pandas, which `vllm-cpu` leaves to its `bench` extra."""
    if subprocess.run([vllm_python, "-c", "import pandas"], capture_output=True).returncode != 0:
        raise SystemExit(f"{vllm_python} has no pandas, which `vllm bench serve --dataset-name custom` needs: "
                         f"{Path(vllm_python).parent / 'pip'} install pandas")


def vllm_client(vllm_python: str, server: ServerProcess, tokenizer_dir: str, mode: str, concurrency: int,
                num_prompts: int, args) -> Row:
    with tempfile.TemporaryDirectory() as out_dir:
        dataset = vllm_dataset_flags(bench_args(server, tokenizer_dir, mode, concurrency, num_prompts, args), out_dir)
        command = [
            vllm_python, "-c", VLLM_LAUNCHER, "bench", "serve", "--backend", "vllm", "--base-url", server.base_url,
            "--model", server.model_dir, "--tokenizer", tokenizer_dir, *dataset,
            "--ignore-eos", "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "95", "--seed", str(run_seed(mode, concurrency)),
            "--disable-tqdm", "--save-result", "--result-dir", out_dir, "--result-filename", "result.json",
        ]
        if MODES[mode] is not None:
            command += ["--temperature", str(MODES[mode])]
        if args.extra_body:
            command += ["--extra-body", json.dumps(args.extra_body)]
        if args.random_range_ratio:
            command += ["--random-range-ratio", str(args.random_range_ratio)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        done = subprocess.run(command, env=env, cwd=out_dir, capture_output=True, text=True, timeout=3600)
        path = Path(out_dir) / "result.json"
        if not path.is_file():
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(path.read_text())
    if result.get("completed", 0) != num_prompts:
        raise RuntimeError(f"vllm bench serve: {result.get('completed')} of {num_prompts} requests completed")
    rate = result.get("spec_decode_acceptance_rate")  # a percentage, when the server speculates
    return Row("vllm bench serve", mode, concurrency, "", result["output_throughput"], result["p95_ttft_ms"],
               result["mean_tpot_ms"], None if rate is None else rate / 100)


def shardserve_client(server: ServerProcess, tokenizer_dir: str, mode: str, concurrency: int, num_prompts: int,
                      args) -> Row:
    settings = bench_args(server, tokenizer_dir, mode, concurrency, num_prompts, args)
    [summary] = asyncio.run(run_bench(settings)).summaries
    if summary.failures:
        raise RuntimeError(f"shardserve bench: {summary.failures} failed requests")
    rate = summary.spec_acceptance_rate
    return Row("shardserve bench", mode, concurrency, "", summary.output_throughput, summary.ttft_p95_ms,
               summary.tpot_mean_ms, None if math.isnan(rate) else rate)  # nan: the server does not speculate


def served_rows(label: str, server: ServerProcess, tokenizer_dir: str, args) -> list[Row]:
    rows = []
    levels = list(zip(args.concurrency, args.num_prompts, strict=True))
    with server.start(timeout_s=900):
        for client in args.clients:
            for mode in args.modes:
                for concurrency, num_prompts in levels:
                    if client == "vllm":
                        row = vllm_client(args.vllm_python, server, tokenizer_dir, mode, concurrency, num_prompts, args)
                    else:
                        row = shardserve_client(server, tokenizer_dir, mode, concurrency, num_prompts, args)
                    row.server = label
                    rows.append(row)
                    accepted = "" if row.spec_acceptance_rate is None else (
                        f"  acceptance {100 * row.spec_acceptance_rate:.1f}%")
                    print(f"{label:10} {row.client:17} {mode:7} C={concurrency:<3} {row.tok_s:7.1f} tok/s  "
                          f"TTFT p95 {row.ttft_p95_ms:7.1f} ms  TPOT {row.tpot_mean_ms:6.1f} ms{accepted}", flush=True)
    return rows


def table(rows: list[Row], offline: dict[str, dict[str, float]], baseline: str = "vllm") -> str:
    """Each shardserve row beside the baseline server's (`vllm`, or `off`: shardserve without speculation)."""
    by_key = {(r.client, r.mode, r.concurrency, r.server): r for r in rows}
    theirs, ours_name = ("vLLM", "shardserve") if baseline == "vllm" else ("off", "on")
    lines = [
        f"| client | sampling | C | {theirs} tok/s | {ours_name} tok/s | ratio | TTFT p95 {theirs} / {ours_name} ms | "
        f"ratio | TPOT mean {theirs} / {ours_name} ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (client, mode, concurrency, server), ours in by_key.items():
        peer = by_key.get((client, mode, concurrency, baseline))
        if server != "shardserve" or peer is None:
            continue
        lines.append(
            f"| {client} | {mode} | {concurrency} | {peer.tok_s:.0f} | {ours.tok_s:.0f} | "
            f"{ours.tok_s / peer.tok_s:.2f}× | {peer.ttft_p95_ms:.0f} / {ours.ttft_p95_ms:.0f} | "
            f"{ours.ttft_p95_ms / peer.ttft_p95_ms:.2f}× | {peer.tpot_mean_ms:.1f} / {ours.tpot_mean_ms:.1f} | "
            f"{ours.tpot_mean_ms / peer.tpot_mean_ms:.2f}× |"
        )
    if offline:
        lines += ["", "| offline (64 × 512 → 128) | vLLM tok/s | shardserve tok/s | ratio |", "|---|---|---|---|"]
        for mode in OFFLINE_MODES:
            peer, ours = offline["vllm"][mode], offline["shardserve"][mode]
            label = "greedy" if mode == "greedy" else "temperature 1.0"
            lines.append(f"| {label} | {peer:.0f} | {ours:.0f} | {ours / peer:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu (scripts/setup_peer.sh)")
    parser.add_argument("--model", help="model directory (default: the bench preset)")
    parser.add_argument("--real-model", action="store_true",
                        help="the demo model (SmolLM2-135M-Instruct): shardserve reads its GGUF file, vLLM the same "
                             "weights written out as a Hugging Face directory (scripts/gguf_to_hf.py); default "
                             "loads 1/10/50, sampled, vLLM's client only")
    parser.add_argument("--concurrency", help="default 1,10,50,100 (1,10,50 with --real-model)")
    parser.add_argument("--num-prompts", help="one per concurrency: default 30,200,500,600 (30,150,300)")
    parser.add_argument("--clients", help="vllm (vllm bench serve) and/or shardserve (default both; vllm with "
                                          "--real-model)")
    parser.add_argument("--modes", help="sampled and/or greedy (default both; sampled with --real-model)")
    parser.add_argument("--dataset-name", choices=["random", "grounded"], default="random",
                        help="the served runs' prompts: random token ids (vLLM's random dataset), or grounded, the "
                             "same passages to repeat or edit for both clients (bench/grounded.py; vLLM's custom "
                             "dataset); the offline runs stay random (default: random)")
    parser.add_argument("--speculative-config", help="JSON that both servers start with (default: none)")
    parser.add_argument("--baseline", choices=["vllm", "speculation-off"], default="vllm",
                        help="the server shardserve is set beside: vLLM's (default), or shardserve itself without "
                             "--speculative-config (which is then required; vLLM's client still loads both)")
    parser.add_argument("--extra-body", type=json_object, help="JSON merged into every request by both clients, e.g. a response_format "
                        "(vllm bench serve's flag; default: none)")
    parser.add_argument("--baseline-last", action="store_true",
                        help="serve shardserve first and the baseline second (a drift of the machine over the run "
                             "then reads the other way)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="prompt and output lengths drawn from [1 - r, 1 + r] times --prompt-tokens and "
                             "--output-tokens (vllm bench serve's flag, random dataset, its client only; default 0: "
                             "every prompt of the same length)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--no-offline", dest="offline", action="store_false")
    parser.add_argument("--no-served", dest="served", action="store_false")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    if args.baseline == "speculation-off" and not args.speculative_config:
        parser.error("--baseline speculation-off compares shardserve with and without --speculative-config: give it")
    if args.write_doc and (args.dataset_name != "random" or args.speculative_config or args.extra_body
                           or args.random_range_ratio):
        parser.error("--write-doc writes the random load without speculation, the doc's side by side")
    defaults = REAL_MODEL_DEFAULTS if args.real_model else BENCH_MODEL_DEFAULTS
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.num_prompts = [int(n) for n in args.num_prompts.split(",")]
    args.clients = args.clients.split(",")
    args.modes = args.modes.split(",")
    if args.random_range_ratio and (args.dataset_name != "random" or "shardserve" in args.clients):
        parser.error("--random-range-ratio is vllm bench serve's, on the random dataset: give --clients vllm")
    if args.served and args.dataset_name == "grounded" and "vllm" in args.clients:
        check_custom_dataset_support(args.vllm_python)
    dtype = "bfloat16" if cpu_supports_bf16() else "float32"
    if args.real_model:
        from engine.checkpoint.demo import ensure_demo_model

        model_dir = str(ensure_demo_model())  # what shardserve loads and serves
        peer_model_dir = tokenizer_dir = str(real_model_hf_dir(Path(model_dir), dtype))
    else:
        model_dir = peer_model_dir = tokenizer_dir = str(Path(args.model) if args.model else bench_model_dir())
    vocab_size = load_model_config(model_dir).vocab_size
    load_before = os.getloadavg()[0]
    started = time.gmtime()

    offline: dict[str, dict[str, float]] = {}
    if args.offline:
        # a prompt set per mode: no run can reuse another's prefill
        prompts = {mode: make_prompts(64, args.prompt_tokens, vocab_size, seed=seed)
                   for seed, mode in enumerate(OFFLINE_MODES)}
        arguments = {"model": model_dir, "dtype": dtype, "prompts": prompts, "output_len": args.output_tokens}
        with tempfile.TemporaryDirectory() as neutral:  # vLLM run from the repository would import its packages
            vllm_env = vllm_cpu_env(args.vllm_python, _tcmalloc(args.vllm_python))
            offline["vllm"] = offline_run([args.vllm_python, "-c", _VLLM_OFFLINE],
                                          {**arguments, "model": peer_model_dir}, vllm_env, neutral)
        # in a child process too, so this one holds no engine while the servers run
        offline["shardserve"] = offline_run([sys.executable, "-c", _SHARDSERVE_OFFLINE], arguments, {}, REPO)
        print(f"offline: {offline}", flush=True)
    rows: list[Row] = []
    if args.served:
        speculative = ["--speculative-config", args.speculative_config] if args.speculative_config else []
        if args.baseline == "vllm":
            peer = ServerProcess.vllm(args.vllm_python, peer_model_dir, dtype, _tcmalloc(args.vllm_python))
            peer.command += speculative
            label = "vllm"
        else:
            peer, label = ServerProcess(model_dir, extra_args=["--dtype", dtype]), "off"
        ours = ServerProcess(model_dir, extra_args=["--dtype", dtype, *speculative])
        runs = [(label, peer), ("shardserve", ours)]
        for name, server in reversed(runs) if args.baseline_last else runs:
            rows += served_rows(name, server, tokenizer_dir, args)
    flag = " --real-model" if args.real_model else ""
    if args.dataset_name != "random":
        flag += f" --dataset-name {args.dataset_name}"
    if args.speculative_config:
        flag += f" --speculative-config '{args.speculative_config}'"
    if args.baseline != "vllm":
        flag += f" --baseline {args.baseline}"
    if args.baseline_last:
        flag += " --baseline-last"
    if args.extra_body:
        flag += f" --extra-body '{json.dumps(args.extra_body)}'"
    model_text = (
        f"the demo model, SmolLM2-135M-Instruct (30 layers, hidden 576): shardserve loads `{Path(model_dir).name}`, "
        "vLLM the same dequantized weights as a Hugging Face directory (`scripts/gguf_to_hf.py`)"
        if args.real_model else f"model `{Path(model_dir).name}`"
    )
    body = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', started)} by `python -m scripts.bench_peer{flag}` at commit "
        f"{git_commit()} on {cpu_description()}, load average {load_before:.1f} before the run: {model_text}, "
        f"in {dtype}, {args.prompt_tokens} prompt → {args.output_tokens} output tokens "
        + (f"(each length drawn from ±{args.random_range_ratio:g} of it, `--random-range-ratio`) "
           if args.random_range_ratio else "")
        + f"(ignore_eos), prompts per concurrency {args.num_prompts}. "
        + (f"vLLM: `vllm-cpu` {vllm_version(args.vllm_python)}, `--no-enable-prefix-caching`, all cores to its "
           "engine, TCMalloc and Intel OpenMP preloaded; shardserve with its defaults; "
           f"{'shardserve' if args.baseline_last else 'vLLM'}'s server ran first. "
           if args.baseline == "vllm" else
           "shardserve with its defaults, without --speculative-config (*off*) and with it (*on*), "
           f"{'on' if args.baseline_last else 'off'} first. ")
        + "*sampled* sends no temperature (each server's default, 1.0), *greedy* sends 0.",
        "",
        table(rows, offline, "vllm" if args.baseline == "vllm" else "off"),
        "",
        f"Command: `python -m scripts.bench_peer --vllm-python $(bash scripts/setup_peer.sh){flag} --write-doc` "
        "(in `make bench`)",
    ])
    print(body)
    if args.write_doc:
        if args.real_model:
            rewrite_block(REAL_BEGIN, REAL_END, body, "Side by side with vLLM: the real model")
        else:
            rewrite_block(BEGIN, END, body, "Side by side with vLLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
