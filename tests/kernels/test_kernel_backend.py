"""Which implementation `get_backend` hands the model code, and that CPU users never import Triton."""

import subprocess
import sys
from pathlib import Path

import pytest

from kernels.backend import TORCH, get_backend


def test_auto_is_the_torch_reference_on_cpu_even_under_the_interpreter():
    assert get_backend("auto", "cpu") is TORCH


def test_torch_is_the_reference_everywhere():
    assert get_backend("torch", "cpu") is TORCH
    assert get_backend("torch", "cuda") is TORCH


def test_auto_and_triton_are_the_triton_kernels_on_cuda():
    assert get_backend("auto", "cuda").name == "triton"
    assert get_backend("triton", "cuda") is get_backend("auto", "cuda")


def test_triton_on_cpu_runs_in_the_interpreter_when_it_is_enabled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_backend("triton", "cpu").name == "triton"


def test_triton_on_cpu_without_the_interpreter_says_how_to_enable_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


def test_an_unknown_backend_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="'auto', 'torch' or 'triton'"):
        get_backend("cuda-graphs", "cpu")


def test_the_torch_backend_runs_without_importing_triton():
    script = (
        "import sys, torch\n"
        "from kernels.backend import get_backend\n"
        "backend = get_backend('auto', 'cpu')\n"
        "backend.silu_and_mul(torch.randn(2, 8))\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=Path(__file__).parents[2])
