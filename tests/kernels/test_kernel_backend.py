"""Which implementation `get_backend` hands the model code, and that CPU users never import Triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from native_builds import amx_tiles_expected

from kernels import cpu_native
from kernels.attention import paged_decode_attention_torch
from kernels.backend import TORCH, get_backend, native_cpu_backend


def test_auto_on_cpu_is_the_native_backend_even_under_the_interpreter():
    backend = get_backend("auto", "cpu")
    assert backend.name == "cpu" and backend is get_backend("cpu", "cpu")
    # attention, the KV write and the per-token ops are native
    for op in ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "silu_and_mul",
               "rotary_embedding"):
        assert getattr(backend, op) is not getattr(TORCH, op), op


def test_the_native_backend_falls_back_to_the_reference_for_float16():
    """The C++ kernel takes float32 and bfloat16; anything else goes to the reference, same answer."""
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 2, 4, 16, 64, generator=generator).half()
    query = torch.randn(2, 4, 64, generator=generator).half()
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 32], dtype=torch.int32)
    out = get_backend("cpu", "cpu").paged_decode_attention(query, kv_cache, tables, lens, 0.125)
    assert torch.equal(out, paged_decode_attention_torch(query, kv_cache, tables, lens, 0.125))


def test_cpu_backend_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match="kernel backend 'cpu' needs a CPU device"):
        get_backend("cpu", "cuda")


def test_native_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CPU_KERNELS", "0")
    assert not cpu_native.enabled()
    monkeypatch.setenv("SHARDSERVE_CPU_KERNELS", "1")
    assert cpu_native.enabled()


def test_each_build_runs_the_vector_code_of_its_target(native_target):
    """The native build runs the widest vector code the CPU has; the avx2 build (-march=haswell) AVX2's
    even on an AVX-512 CPU, so those paths, AMD Zen 2 and 3's, are tested there too."""
    flags = cpu_native.cpu_flags()
    if native_target == "avx2":
        expected = "avx2"
    elif "avx512f" in flags:
        expected = "avx512"
    else:
        expected = "avx2" if {"avx2", "fma"} <= flags else "scalar"
    assert cpu_native.load(native_target).vector_isa() == expected


def test_shardserve_cpu_isa_picks_the_build_cpu_and_auto_run(monkeypatch, native_target):
    from kernels.backend import engine_cpu_backend

    monkeypatch.setenv("SHARDSERVE_CPU_ISA", native_target)
    engines = engine_cpu_backend(native_target)
    assert get_backend("cpu", "cpu") is engines and get_backend("auto", "cpu") is engines


def test_an_unknown_shardserve_cpu_isa_is_rejected_with_the_choices(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CPU_ISA", "avx10")
    with pytest.raises(ValueError, match="SHARDSERVE_CPU_ISA='avx10': choose one of native, avx2"):
        get_backend("cpu", "cpu")


def test_switched_off_auto_is_the_plain_reference():
    script = (
        "from kernels.backend import TORCH, get_backend\n"
        "assert get_backend('auto', 'cpu') is TORCH\n"
        "try:\n"
        "    get_backend('cpu', 'cpu')\n"
        "except ValueError as exc:\n"
        "    assert 'SHARDSERVE_CPU_KERNELS' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('cpu backend without the native kernels')\n"
    )
    env = {**os.environ, "SHARDSERVE_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=Path(__file__).parents[2], env=env)


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
    with pytest.raises(ValueError, match="'auto', 'cpu', 'torch' or 'triton'"):
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


def test_native_kernels_refuse_tables_and_positions_outside_the_cache(native_target, native):
    """They read blocks and cos/sin rows by index: bad indices are a clear error, never a stray read."""
    kv_cache = torch.zeros(2, 2, 4, 16, 64)
    query = torch.zeros(1, 4, 64)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 9 outside the cache's 4 blocks"):
        native.paged_decode_attention(query, kv_cache, torch.tensor([[0, 9]], dtype=torch.int32), lens, 0.1)
    with pytest.raises(RuntimeError, match="exceeds its 1-block table"):
        native.paged_decode_attention(query, kv_cache, torch.tensor([[0]], dtype=torch.int32), lens, 0.1)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    # the native prefill kernel itself: built with AVX-512 or AVX2 it checks the table; without, it refuses to
    # run (and the backend runs the torch reference)
    expected = "block id -1 outside" if cpu_native.prefill_supported(64, 16, native_target) else "needs AVX-512"
    with pytest.raises(RuntimeError, match=expected):
        cpu_native.load(native_target).paged_prefill_attention(
            query, kv_cache, torch.tensor([[0, -1]], dtype=torch.int32), starts, lens, 0.1
        )
    cos_sin = torch.zeros(8, 64)
    with pytest.raises(RuntimeError, match="position 8 outside"):
        native.rotary_embedding(torch.tensor([8]), query, torch.zeros(1, 2, 64), cos_sin)


def test_the_engines_backend_leaves_bfloat16_prefill_to_the_reference_only_on_amx_without_the_tile_kernel():
    """bfloat16 prefill attention: the native kernel wherever it is faster, which is everywhere its build can run
    (on an AMX CPU the AMX tile kernel, elsewhere the vector loop); torch's (oneDNN on AMX) only on an AMX CPU whose
    native build may not use the tiles. float32 stays native everywhere. native_cpu_backend, which the kernel tests
    use, is all native."""
    from kernels.backend import reference_bf16_prefill_is_faster

    generator = torch.Generator().manual_seed(4)
    lens = torch.tensor([40, 23], dtype=torch.int32)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    starts = torch.tensor([0, 40, 63], dtype=torch.int32)
    engines, native = get_backend("cpu", "cpu"), native_cpu_backend(cpu_native.isa())
    amx_cpu = "amx_bf16" in cpu_native.cpu_flags()
    tile_kernel = cpu_native.load().prefill_amx_available()
    assert tile_kernel == amx_tiles_expected(cpu_native.isa())
    for dtype in (torch.bfloat16, torch.float32):
        kv_cache = torch.randn(2, 2, 6, 16, 64, generator=generator).to(dtype)
        query = torch.randn(63, 4, 64, generator=generator).to(dtype)
        args = (query, kv_cache, tables, starts, lens, 0.125)
        out, by_torch, by_native = (b.paged_prefill_attention(*args) for b in (engines, TORCH, native))
        assert not torch.equal(by_torch, by_native)  # the two are told apart
        expected = by_torch if dtype == torch.bfloat16 and amx_cpu and not tile_kernel else by_native
        assert torch.equal(out, expected), dtype
    assert reference_bf16_prefill_is_faster() == (amx_cpu and not tile_kernel)


def test_short_bfloat16_chunks_stay_native_even_where_long_ones_go_to_the_reference():
    """A chunk of at most NATIVE_BF16_PREFILL_MAX_QUERY_ON_AMX queries (a speculative verification) runs the
    native kernel on every CPU, also in a step whose other chunks are long; a longer chunk goes where the long
    prefills go (the reference on an AMX CPU whose native build may not use the tiles). Each chunk's rows equal
    what its kernel gives for it."""
    from kernels.backend import NATIVE_BF16_PREFILL_MAX_QUERY_ON_AMX as short

    generator = torch.Generator().manual_seed(5)
    from kernels.backend import reference_bf16_prefill_is_faster

    to_reference = reference_bf16_prefill_is_faster()  # long chunks go to torch's attention
    engines, native = get_backend("cpu", "cpu"), native_cpu_backend(cpu_native.isa())
    kv_cache = torch.randn(2, 2, 12, 16, 64, generator=generator).to(torch.bfloat16)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], dtype=torch.int32)
    for chunk_lens in ([5, 3], [short, 2], [3, short + 1, 5, 40], [short + 1, 20]):
        starts = torch.tensor([0, *torch.tensor(chunk_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([40, 23, 30, 44][: len(chunk_lens)], dtype=torch.int32)
        query = torch.randn(sum(chunk_lens), 4, 64, generator=generator).to(torch.bfloat16)
        args = (query, kv_cache, tables[: len(chunk_lens)], starts, lens, 0.125)
        by_torch, by_native = TORCH.paged_prefill_attention(*args), native.paged_prefill_attention(*args)
        assert not torch.equal(by_torch, by_native)
        out = engines.paged_prefill_attention(*args, max_query_len=max(chunk_lens))
        for chunk, n in enumerate(chunk_lens):
            rows = slice(int(starts[chunk]), int(starts[chunk + 1]))
            expected = by_torch if to_reference and n > short else by_native
            assert torch.equal(out[rows], expected[rows]), (chunk_lens, chunk)
