"""Which Triton kernels a piece of code launches, and which compiled variant each launch needs, recorded
without running anything: the wrappers run on meta tensors (or any tensors) while `record_launches()`
catches every `kernel[grid](...)` call.

A variant is what Triton compiles once and caches: the kernel, its constexpr values, its launch options,
and the specialisation Triton derives from the other arguments (pointer dtypes and 16-byte alignment,
integers equal to 1 or divisible by 16, 32- or 64-bit). A launch whose variant has not been compiled yet
pays a compile (about a second or more) on the request that meets it first: the engine's start-up
warm-up (engine/warmup.py) launches every variant its steps can need, and the compile-only check
(scripts/gpu_check.py --compile-only) builds each recorded launch for sm_90 from these records.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass(frozen=True)
class TritonLaunch:
    """One recorded `kernel[grid](*args, **kwargs)`: the kernel object, its arguments by name, its options."""

    kernel: Any  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
    arguments: tuple[tuple[str, Any], ...]  # (parameter name, value), in the kernel's parameter order
    options: tuple[tuple[str, Any], ...]  # num_warps, num_stages, ... as launched
    grid: tuple

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexprs(self) -> dict[str, Any]:
        names = constexpr_names(self.kernel)
        return {name: value for name, value in self.arguments if name in names}

    def variant(self) -> tuple:
        """What Triton's cache keys a compile on: equal variants share one compiled kernel."""
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        names = constexpr_names(self.kernel)
        key = []
        for name, value in self.arguments:
            if name in names:
                key.append((name, value))
            else:
                key.append((name, *native_specialize_impl(BaseBackend, value, False, True, True)))
        return (self.name, tuple(key), self.options)

    def describe(self) -> str:
        """The kernel and its variant in one line: constexprs, options and the specialised integers."""
        constexprs = ", ".join(f"{k}={v}" for k, v in self.constexprs().items())
        options = ", ".join(f"{k}={v}" for k, v in self.options)
        specialised = [f"{entry[0]}:{entry[2]}" for entry in self.variant()[1]
                       if len(entry) == 3 and entry[1] in ("i32", "i64", "constexpr") and entry[2] not in ("", None)]
        return f"{self.name}({constexprs}; {options or 'default options'}; {' '.join(specialised) or '-'})"


def constexpr_names(kernel: Any) -> set[str]:
    """The kernel's tl.constexpr parameters (annotations may be strings under `from __future__ import annotations`)."""
    fn = getattr(kernel, "fn", kernel)
    return {
        name for name, param in inspect.signature(fn).parameters.items()
        if "constexpr" in str(param.annotation)
    }


@contextmanager
def record_launches() -> Iterator[list[TritonLaunch]]:
    """Within the block, every Triton launch is recorded instead of run (its outputs stay as allocated)."""
    from triton.runtime.jit import KernelInterface

    launches: list[TritonLaunch] = []
    original = KernelInterface.__getitem__

    def recorder(kernel, grid):
        def launch(*args, **kwargs):
            names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
            options = tuple((k, kwargs.pop(k)) for k in LAUNCH_OPTIONS if k in kwargs)
            bound = dict(zip(names, args)) | kwargs
            arguments = tuple((name, bound[name]) for name in names if name in bound)
            launches.append(TritonLaunch(kernel, arguments, options, tuple(grid) if not callable(grid) else ()))

        return launch

    KernelInterface.__getitem__ = recorder
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original


def distinct_variants(launches: list[TritonLaunch]) -> dict[tuple, TritonLaunch]:
    """The first launch of each variant, keyed by the variant, in the order they were first seen."""
    variants: dict[tuple, TritonLaunch] = {}
    for launch in launches:
        variants.setdefault(launch.variant(), launch)
    return variants
