"""Degraded states: a worker that serves, but slower than it should, says so loudly.

A worker whose CUDA graphs could not be captured (or replayed something else than the
eager forward), whose Triton kernels failed to compile, or that runs the pure-torch
attention on a CPU for lack of a compiler still gives correct tokens, only several times
slower. Before, each of these logged one line at start and the worker ran slowly
forever. Now every such state is recorded here once: an error-level log event named after
the reason, and from ``EngineStats`` a Prometheus gauge per reason
(``ferry_worker_degraded``), a field of the heartbeat and a mark in ``ferry top``.
"""

from __future__ import annotations

import structlog

log = structlog.get_logger("ferry.worker.health")

DEGRADED_REASONS = (
    "decode_graphs_unavailable",  # capture failed: every decode step runs eagerly
    "decode_graph_mismatch",  # a replay disagreed with the eager forward: graphs dropped
    "attention_kernel_failed",  # a Triton kernel failed to compile/run at start: torch attention
    "cpu_attention_fallback",  # no C++ compiler on a CPU worker: the slower torch attention
    "sampling_kernel_failed",  # the fused sampling pass failed to build: its torch twin
)
"""Every reason a worker may report; exported as gauge labels from the start (zeros)."""


class EngineHealth:
    """The degraded states of one engine, and whether its decode steps replay graphs."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}  # reason -> what happened (the error message)
        self.decode_graphs_active = False

    def degrade(self, reason: str, detail: str, **context: object) -> None:
        """Record ``reason`` (one of ``DEGRADED_REASONS``) with an error-level log event."""
        if reason not in DEGRADED_REASONS:
            raise ValueError(f"unknown degraded reason {reason!r}")
        self.reasons[reason] = detail
        log.error(reason, error=detail, degraded=True, **context)

    @property
    def degraded(self) -> tuple[str, ...]:
        return tuple(sorted(self.reasons))


class DeviceFault(RuntimeError):
    """The device can no longer be used (``is_device_fault``): the process must end.

    Raised by ``Engine.step`` instead of failing the batch: after an illegal address or a
    device-side assert the CUDA context is broken, so every later step would fail too (a
    zombie worker). The service ends, hands its requests back so another worker resumes
    them, and the process exits non-zero for its supervisor to restart it."""


_DEVICE_FAULT_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error",
                         "device-side assert", "illegal memory access", "unspecified launch")


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the CUDA context unusable (an illegal address, a device-side
    assert, a launch failure): every later step of this process would fail too.

    Out of memory is not one of them (the allocator recovers), nor is a Triton compile
    error. torch raises ``torch.AcceleratorError`` for CUDA runtime errors; older code
    paths raise a ``RuntimeError`` whose message names the CUDA error.
    """
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc):
        return False
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_FAULT_MARKERS)


def raise_if_device_fault(exc: Exception) -> None:
    """Re-raise ``exc`` as a ``DeviceFault`` when the CUDA context did not survive it (or
    it is one already: a tensor-parallel rank lost, ``runner/tp_ranks.py``)."""
    if isinstance(exc, DeviceFault):
        raise exc
    if is_device_fault(exc):
        raise DeviceFault(f"{type(exc).__name__}: {exc}") from exc
