"""Wake-ups per second of each process of a running `shardserve serve`, idle and under load (issue 29).

On a CPU node every wake-up of a Ray or Serve process (the GCS, the raylet, the controller, the proxy, the
replica's own Ray threads) is a context switch on the cores the engine computes on. This counts them: each
process's voluntary + involuntary context switches, summed over its threads (/proc/PID/task/*/status), over a
window; the processes are the server's process tree, named by their Ray titles. It starts the server itself with
the given flags (one run per --control-plane profile, in turn), measures it idle for --idle-s, then under a
bounded load (--load-prompts prompts at --load-concurrency, streamed, 127.0.0.1 only), and prints one table.

    python -m scripts.profile_wakeups --control-plane default,quiet
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx

from app.ray_cluster import descendants
from scripts.bench_serve import ServerProcess
from scripts.bench_serve_overhead import served_load


def process_tree(root: int) -> list[int]:
    """root and its descendants."""
    return [root, *descendants(root)]


def process_name(pid: int) -> str:
    """A short name: Ray's title (ray::ServeReplica:app:LLMServer, ray::ProxyActor) or the program's."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = cmd[0].decode(errors="replace")
    if first.startswith("ray::"):
        return re.sub(r"\s.*", "", first)
    words = [c.decode(errors="replace") for c in cmd if c]
    for word in words:
        for known in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "app.cli",
                      "default_worker"):
            if known in word:
                return known
    return Path(first).name


def switches(pid: int) -> int:
    """Context switches of all of pid's threads so far."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def snapshot(root: int) -> dict[int, tuple[str, int]]:
    return {pid: (process_name(pid), switches(pid)) for pid in process_tree(root)}


def rates(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Wake-ups per second per process name (processes of one name summed)."""
    out: dict[str, float] = {}
    for pid, (name, count) in after.items():
        if pid in before:
            out[name] = out.get(name, 0.0) + (count - before[pid][1]) / seconds
    return out


async def measure_under_load(server: ServerProcess, model: str, prompts, concurrency: int) -> tuple[dict, float]:
    root = server.process.pid
    before, start = snapshot(root), time.monotonic()
    tok_s = await served_load(server.base_url, model, prompts, 128, concurrency, 1.0)
    seconds = time.monotonic() - start
    return rates(before, snapshot(root), seconds), tok_s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench-shaped model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--control-plane", default="default,quiet", help="profiles to compare, one server each")
    parser.add_argument("--http-ingress", default="auto")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--load-prompts", type=int, default=60)
    parser.add_argument("--load-concurrency", type=int, default=10)
    parser.add_argument("--load-prompt-tokens", type=int, default=512)
    args = parser.parse_args(argv)

    from engine.checkpoint.random_model import ensure_bench_model

    model_dir = args.model or str(ensure_bench_model())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    results = {}
    for profile in args.control_plane.split(","):
        server = ServerProcess(model_dir, extra_args=["--dtype", args.dtype, "--max-model-len", "1024",
                                                      "--control-plane", profile, "--http-ingress", args.http_ingress])
        with server.start(timeout_s=300):
            model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
            asyncio.run(served_load(server.base_url, model, [[5, 6, 7]] * 4, 2, 4, 1.0))  # warm-up
            root = server.process.pid
            before = snapshot(root)
            time.sleep(args.idle_s)  # the idle window itself: what the processes do when nothing is asked
            idle = rates(before, snapshot(root), args.idle_s)
            prompts = [[rng.randrange(3, vocab) for _ in range(args.load_prompt_tokens)]
                       for _ in range(args.load_prompts)]
            load, tok_s = asyncio.run(measure_under_load(server, model, prompts, args.load_concurrency))
        results[profile] = (idle, load, tok_s)
        print(f"{profile}: idle {sum(idle.values()):.0f}/s, under load {sum(load.values()):.0f}/s, {tok_s:.0f} tok/s",
              flush=True)

    names = sorted({n for idle, load, _ in results.values() for n in (*idle, *load)},
                   key=lambda n: -max(results[p][1].get(n, 0) for p in results))
    profiles = list(results)
    print(f"\nwake-ups per second (context switches), idle {args.idle_s:.0f} s / under load (c={args.load_concurrency},"
          f" {args.load_prompts} x {args.load_prompt_tokens} -> 128, sampled)\n")
    print("| process | " + " | ".join(f"{p} idle | {p} load" for p in profiles) + " |")
    print("|---|" + "---|---|" * len(profiles))
    for name in names:
        cells = [f"{results[p][0].get(name, 0):.0f} | {results[p][1].get(name, 0):.0f}" for p in profiles]
        print(f"| {name} | " + " | ".join(cells) + " |")
    totals = [f"{sum(results[p][0].values()):.0f} | {sum(results[p][1].values()):.0f}" for p in profiles]
    print("| **all** | " + " | ".join(totals) + " |")
    print("| tok/s under load | " + " | ".join(f" | {results[p][2]:.0f}" for p in profiles) + " |")


if __name__ == "__main__":
    main()
