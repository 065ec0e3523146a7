"""scripts/gpu_check.py cannot run its GPU checks here, but it is rehearsed here step by step (--dry-run, on CPU
with the torch references), it must survive any one failing step, and its kernels must compile for Hopper
without spilling, so that a GPU session (about 15 minutes, once) only has to run it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
KERNELS = [
    "_decode_partition_kernel",
    "_merge_partitions_kernel",
    "_prefill_kernel",
    "_write_kv_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_silu_and_mul_kernel",
    "_sample_kernel",
    "_apply_bitmask_kernel",
]
# the steps' rows, in the order the script runs them
DRY_RUN_ROWS = [
    "device: CPU rehearsal",
    "decode b3 ctx333 float32",
    "prefill b2 ctx100 chunk17 bfloat16",
    "write_kv_cache bfloat16",
    "engine TP=1",
    "first request",
    "decode batch 4",
    "engine greedy tokens, kernels vs torch references",
    "device-to-device copy",
    "decode kernel b",
    "prefill SDPA",
    "sample_tokens 8 x 151936",
    "apply_token_bitmask 32 of 64 rows x 151936",
    "swap path",
    "TP=2 (two processes, one device, gloo) vs TP=1",
]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_arguments_parse(gpu_check, tmp_path):
    args = gpu_check.parse_args(["--out", str(tmp_path), "--iters", "7", "--skip-engine", "--wheels", ".whl"])
    assert (args.out, args.iters, args.skip_engine, args.compile_only, args.dry_run) == (tmp_path, 7, True, False, False)
    assert args.wheels == Path(".whl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the answer on a machine without a GPU")
def test_without_a_gpu_it_refuses_with_a_nonzero_exit(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_failing_step_is_a_failed_row_and_every_other_step_still_runs(gpu_check, monkeypatch, tmp_path, capsys):
    from scripts import gpu_check_kernels

    real = gpu_check_kernels.check_close

    def failing_once(name, *args):
        if name.startswith("decode b3"):
            raise gpu_check_kernels.Mismatch(f"{name}: planted")
        return real(name, *args)

    monkeypatch.setattr(gpu_check_kernels, "check_close", failing_once)
    assert gpu_check.main(["--dry-run", "--skip-engine", "--iters", "1", "--out", str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    assert "| decode b3 ctx333 float32 | FAILED | Mismatch: decode b3 ctx333 float32: planted |" in printed
    assert "| apply_token_bitmask 32 of 64 rows x 151936 | exact |" in printed  # the last step still ran
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["failures"] == ["decode b3 ctx333 float32", "decode b3 ctx333 bfloat16"]
    assert "| decode b3 ctx333 float32 | FAILED |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dry_run_rehearses_every_step_on_cpu_and_prints_each_row(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--iters", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    position = 0
    for expected in DRY_RUN_ROWS:  # each row, in order
        position = next(i for i, line in enumerate(printed[position:], position) if line.startswith(f"| {expected}"))
    assert "FAILED" not in done.stdout
    assert len(json.loads((tmp_path / "gpu_check.json").read_text())["rows"]) == len(printed)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_kernel_compiles_for_hopper_without_spilling(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler
    done = subprocess.run([sys.executable, str(SCRIPT), "--compile-only", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # a spill or a shared-memory overrun fails
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"][1:]
    for kernel in KERNELS:
        assert any(row[0].startswith(kernel + "(") for row in rows), kernel
    assert any("SPLIT=True" in row[0] for row in rows) and any("BLOCK_S=64" in row[0] for row in rows)
    assert any("VOCAB=151936" in row[0] for row in rows)
    for name, registers, spills, _ in rows:
        assert 0 < int(registers) <= 255 and spills == "0 / 0", name


def test_the_second_gpu_runs_script_rehearses_its_sweep_its_profile_and_the_sampler_kinds(tmp_path):
    """scripts/gpu_profile.py (the prefill launch settings swept, a decode step profiled, the sampler's kinds
    timed alone) runs whole here, so the next GPU session only has to run it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_profile.py"), "--dry-run", "--iters", "1",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failures"] == []
    firsts = [row[0] for row in report["rows"]]
    for kind in range(4):
        assert any(f.startswith(f"sample_tokens 2 rows of kind {kind}") for f in firsts), firsts
    assert any(f.startswith("prefill (BLOCK_M, BLOCK_N, warps, stages) = (16, 32, 4, 2)") for f in firsts), firsts
    [step] = [row for row in report["rows"] if row[0].startswith("decode step, tiny-shape Llama")]
    assert float(step[1].split()[0]) > 0
    assert any(f.startswith("host: aten::") for f in firsts), firsts
