"""The GPU check: kernels against their references, the engine on CUDA, and the figures docs/BENCHMARKS.md
"On a GPU" reports, in one run that prints each row as it comes and survives any one failure.

    python scripts/gpu_check.py --dry-run                 # here, on CPU: every step with the torch references
    python scripts/gpu_check.py --compile-only [--quick]  # here: every Triton variant built for sm_90, with
                                                          # registers and spills read from the cubins
    python scripts/gpu_check.py --fetch-wheels .whl       # here: the packages the GPU image lacks, as wheels
    python scripts/gpu_check.py --split-demo .cache/demo  # here: the demo model in two parts that fit a call
    python3 scripts/gpu_check.py --wheels .whl --out $OUT # on the GPU machine (see "The device run" below)

Steps, in order: kernels against their torch references; a TP=1 engine on CUDA in bfloat16 with the demo
model (KV cache sized from its profile, two engines at once, Triton kernels against the references'
greedy tokens); decode tokens/s against the measured HBM copy rate; prefill attention against SDPA; the
Triton sampler and the grammar mask at vocab 151,936; the swap path; TP=2 as two processes sharing the one
GPU through a stand-in (gloo) group, against TP=1. A failed step is a FAILED row and the run goes on; the
exit status is 1 if any step failed. Every row is also written to --out (gpu_check.md, gpu_check.json).

The device run. The GPU machine's image (the device tool's notes describe it) has python3 3.12 with
torch (CUDA), triton, transformers, tokenizers, safetensors and numpy, but not pydantic, which the engine
needs: `--fetch-wheels .whl` downloads it here and `--wheels .whl` installs it there (`.whl` is carried).
The demo model's GGUF (94 MiB) is more than one call carries (64 MiB): `--split-demo` cuts it in two,
one call carries the first part to a folder outside the working tree, the next the second (`--demo-parts`); without them the engine
steps run a random model of the bench shape in bfloat16 instead, and say so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# what the device image lacks (checked there first), with the versions this repository runs
IMAGE_LACKS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
               "typing-extensions==4.16.0", "gguf==0.19.0"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.md and gpu_check.json")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median)")
    parser.add_argument("--dry-run", action="store_true", help="every step on CPU with the torch references")
    parser.add_argument("--skip-engine", action="store_true", help="the kernel steps only")
    parser.add_argument("--compile-only", action="store_true", help="build every Triton variant for sm_90; no GPU")
    parser.add_argument("--quick", action="store_true", help="with --compile-only: a few variants of each kernel")
    parser.add_argument("--wheels", type=Path, help="install these wheels first (what the GPU image lacks)")
    parser.add_argument("--fetch-wheels", type=Path, help="download the wheels the GPU image lacks into this folder")
    parser.add_argument("--split-demo", type=Path, help="write the demo model here as two parts")
    parser.add_argument("--demo-parts", type=Path, nargs="+", help="the demo model's parts, in order")
    return parser.parse_args(argv)


@dataclass
class Report:
    """Rows as they come (printed at once), FAILED rows for steps that raised, and the files at the end."""

    rows: list[list[str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # what one step measures for a later one (the copy rate)

    def row(self, *cells) -> None:
        cells = [str(cell) for cell in cells]
        self.rows.append(cells)
        print("| " + " | ".join(cells) + " |", flush=True)

    @contextmanager
    def step(self, name: str):
        """One check: its rows, or a FAILED row with the error (the traceback goes to stderr)."""
        start = time.monotonic()
        try:
            yield
        except Exception as error:  # noqa: BLE001 - any one failure must leave the rest of the run
            self.failures.append(name)
            first = (str(error).strip().splitlines() or [""])[0][:300]
            self.row(name, "FAILED", f"{type(error).__name__}: {first}")
            traceback.print_exc(file=sys.stderr)
        finally:
            print(f"# {name}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)

    def write(self, out: Path | None) -> None:
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        width = max((len(row) for row in self.rows), default=1)
        lines = ["| check |" + " |" * (width - 1), "|" + " --- |" * width]
        lines += ["| " + " | ".join(row + [""] * (width - len(row))) + " |" for row in self.rows]
        (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
        (out / "gpu_check.json").write_text(json.dumps({"rows": self.rows, "failures": self.failures}, indent=1))


def install_wheels(folder: Path) -> None:
    """pip-install the carried wheels into a temporary folder (no index: the GPU machine reaches nothing) and use them."""
    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *map(str, sorted(folder.glob("*.whl")))], check=True)
    sys.path.insert(0, str(site))


def fetch_wheels(folder: Path) -> None:
    """Download IMAGE_LACKS for the GPU image's Python (3.12, manylinux x86-64), no dependencies."""
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.12", "--implementation=cp", *platforms, "-d", str(folder), *IMAGE_LACKS],
                   check=True)
    print("\n".join(sorted(p.name for p in folder.glob("*.whl"))))


def split_demo(folder: Path) -> None:
    """The demo model's GGUF as two files, each small enough for one call to carry."""
    from engine.checkpoint.demo import ensure_demo_model

    data = ensure_demo_model().read_bytes()
    half = len(data) // 2
    for index, part in enumerate((data[:half], data[half:])):
        (folder / str(index)).mkdir(parents=True, exist_ok=True)
        (folder / str(index) / f"demo.part{index}").write_bytes(part)
    print(f"{folder}/0/demo.part0 and {folder}/1/demo.part1: {half} + {len(data) - half} bytes")


def compile_only(args: argparse.Namespace, report: Report) -> None:
    """Every Triton variant built for sm_90: registers, spills and shared memory of each cubin."""
    from kernels.triton_compile import check_variant, compile_variant, hopper_matrix, quick_matrix

    launches = quick_matrix() if args.quick else hopper_matrix()
    report.row(f"{len(launches)} Triton variants, sm_90", "registers", "local / stack bytes", "shared bytes")
    for launch in launches:
        with report.step(launch.describe()):
            variant = compile_variant(launch)
            report.row(launch.describe(), variant.registers, f"{variant.local_bytes} / {variant.stack_bytes}",
                       variant.shared_bytes)
            problem = check_variant(variant)
            if problem:
                raise RuntimeError(problem)


def run_checks(args: argparse.Namespace, report: Report) -> None:
    """The steps, in the order the docstring gives."""
    from scripts.gpu_check_engine import engine_steps
    from scripts.gpu_check_kernels import Target, kernel_steps, sampler_steps, speed_steps

    target = Target.cpu_rehearsal() if args.dry_run else Target.cuda()
    report.row(*target.describe())
    kernel_steps(target, report)
    if not args.skip_engine:
        engine_steps(target, report, args, part="tp1")
    speed_steps(target, report, args.iters)
    sampler_steps(target, report, args.iters)
    if not args.skip_engine:
        engine_steps(target, report, args, part="rest")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        fetch_wheels(args.fetch_wheels)
        return 0
    if args.split_demo:
        split_demo(args.split_demo)
        return 0
    if args.wheels:
        install_wheels(args.wheels)
    report = Report()
    if args.compile_only:
        compile_only(args, report)
    else:
        import torch

        from kernels.backend import triton_interpreter_enabled

        if not args.dry_run and not torch.cuda.is_available():
            print("gpu_check: no CUDA device (--dry-run rehearses every step on CPU; --compile-only builds the "
                  "kernels for sm_90)", file=sys.stderr)
            return 2
        if not args.dry_run and triton_interpreter_enabled():
            print("gpu_check: unset TRITON_INTERPRET to run the kernels on the GPU", file=sys.stderr)
            return 2
        run_checks(args, report)
    report.write(args.out)
    if report.failures:
        print(f"gpu_check: {len(report.failures)} step(s) failed: {', '.join(report.failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
