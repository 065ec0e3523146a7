"""scripts/gpu_check.py cannot run its GPU checks here, but its kernels must compile for Hopper and its
command line must work, so that a GPU session only has to run it."""

import importlib.util
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
]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_parse(gpu_check, tmp_path):
    args = gpu_check.parse_args(["--out", str(tmp_path / "t.md"), "--iters", "7", "--skip-engine"])
    assert (args.out, args.iters, args.skip_engine, args.compile_only) == (tmp_path / "t.md", 7, True, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the answer on a machine without a GPU")
def test_without_a_gpu_it_refuses_with_a_nonzero_exit(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_in_both_dtypes(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"
    }  # the real compiler, not the interpreter
    table = tmp_path / "compiled.md"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--compile-only", "--out", str(table)],
        check=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    text = table.read_text()
    for kernel in KERNELS:
        for dtype in ("bf16", "fp32"):
            assert f"{kernel}, {dtype}" in text or f"{kernel} split-K, {dtype}" in text, (kernel, dtype)
    assert "_decode_partition_kernel split-K" in text
    assert "_sample_kernel, i64 output" in text  # token ids out of float32 logits
