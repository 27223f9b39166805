"""The tensor-parallel size and the checks that refuse a model or host at start.

Refused up front, with a message naming both sides, rather than failing mid-load: a size
larger than the visible devices, or attention heads that do not split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass


class TensorParallelError(ValueError):
    """A tensor-parallel size this host or this model cannot serve."""


@dataclass(frozen=True)
class TPConfig:
    """One worker's tensor-parallel group: its size and this process's rank in it."""

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise TensorParallelError(f"tensor-parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} outside a group of {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1


def check_devices(size: int, device_type: str, visible: int) -> None:
    """Refuse a size larger than the visible CUDA devices (CPU ranks share the host)."""
    if device_type == "cuda" and size > visible:
        raise TensorParallelError(
            f"tensor-parallel size {size} exceeds the {visible} visible CUDA device(s)")


def check_heads(size: int, num_heads: int, num_kv_heads: int) -> None:
    """Refuse a model whose query heads, or KV heads, do not split over ``size`` ranks.

    KV heads fewer than ``size`` are replicated, which needs ``size`` to be a multiple
    of them; more KV heads than ranks must divide evenly.
    """
    if num_heads % size:
        raise TensorParallelError(
            f"tensor-parallel size {size} does not divide the model's {num_heads} "
            "attention heads")
    if num_kv_heads >= size and num_kv_heads % size:
        raise TensorParallelError(
            f"tensor-parallel size {size} does not divide the model's {num_kv_heads} KV heads")
    if num_kv_heads < size and size % num_kv_heads:
        raise TensorParallelError(
            f"tensor-parallel size {size} is not a multiple of the model's {num_kv_heads} "
            "KV heads (needed to replicate them)")
