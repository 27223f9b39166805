"""Multi-LoRA limits: device slots, the largest rank, the host cache's size.

One frozen object, so the slot pool, the loader and (later) ``EngineConfig`` share one
set of numbers; no environment variable is read here (the service wires them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraConfig:
    """How many adapters the device holds at once, and how large they may be."""

    max_loras: int = 4  # device slots: distinct adapters usable in one step
    max_lora_rank: int = 64  # an adapter of a larger rank is refused at load
    max_cpu_loras: int = 16  # adapters kept loaded in host memory (LRU)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
