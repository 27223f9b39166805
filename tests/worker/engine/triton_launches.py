"""Test helper: record every Triton kernel launch the engine makes (under the interpreter)
as the variant a GPU launch would compile, and a graph capturer that runs instead of
capturing.

A variant is what Triton keys its compile cache on: the kernel, its constexprs, the launch
options (num_warps) and each other argument's launch-time specialization, computed here
with Triton's own rule for CUDA (``native_specialize_impl``: dtype, 16-byte alignment of
pointers, ints equal to 1 or divisible by 16), honouring the kernel's
``do_not_specialize`` lists. So a test can check, on a CPU, which launches would compile
on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

decode_attention = importlib.import_module("kernels.decode_attention")
prefill_attention = importlib.import_module("kernels.prefill_attention")
store_kv = importlib.import_module("kernels.store_kv")  # the package exports the function

KERNELS = [(decode_attention, "_decode_split_kernel"), (decode_attention, "_decode_reduce_kernel"),
           (prefill_attention, "_prefill_kernel"), (store_kv, "_store_kv_kernel")]


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, ...]
    variant: tuple[Any, ...]


def variant_of(kernel: Any, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    fn = kernel.fn
    options = getattr(kernel, "kwargs", {})
    keep_value = set(options.get("do_not_specialize") or [])
    keep_align = set(options.get("do_not_specialize_on_alignment") or [])
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | kwargs
    key: list[Any] = [fn.__name__]
    for name, value in sorted(bound.items()):
        param = params.get(name)
        if param is None or "constexpr" in str(param.annotation):  # launch options too
            key.append((name, value))
        else:
            key.append((name, native_specialize_impl(
                CUDABackend, value, False, name not in keep_value, name not in keep_align)))
    return tuple(key)


@dataclass
class LaunchLog:
    """Launches by phase label (``phase`` is set by the test as it goes)."""

    phase: str = ""
    launches: dict[str, list[Launch]] = field(default_factory=dict)

    def variants(self, phase: str) -> set[tuple[Any, ...]]:
        return {launch.variant for launch in self.launches.get(phase, [])}

    def record(self, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> None:
        grid = tuple(grid) if isinstance(grid, tuple | list) else (grid,)
        self.launches.setdefault(self.phase, []).append(
            Launch(kernel.fn.__name__, grid, variant_of(kernel, args, kwargs)))


class _Recording:
    def __init__(self, kernel: Any, log: LaunchLog) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.log.record(self.kernel, grid, args, kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextmanager
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[LaunchLog]:
    log = LaunchLog()
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _Recording(getattr(module, name), log))
    yield log


class RunningCapturer:
    """A ``GraphCapturer`` for the CPU: the warm-up and the "capture" both run the forward
    (a capture records the same launches), and a replay runs it again. ``log.phase`` says
    which phase a launch belongs to (``warm_up:<n>``, ``capture:<n>``, n = the call)."""

    def __init__(self, log: LaunchLog | None = None, fail_capture_end: int | None = None):
        self.log = log or LaunchLog()
        self.fail_capture_end = fail_capture_end  # which capture raises, as capture_end can
        self.calls = 0

    def warm_up(self, fn: Callable[[], None]) -> None:
        self.log.phase = f"warm_up:{self.calls}"
        fn()

    def capture(self, fn: Callable[[], None]) -> Any:
        self.log.phase = f"capture:{self.calls}"
        fn()
        self.calls += 1
        if self.calls - 1 == self.fail_capture_end:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(simulated capture_end failure)")
        self.log.phase = "replay"
        return _Replay(fn)


class _Replay:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        with torch.inference_mode():
            self.fn()
