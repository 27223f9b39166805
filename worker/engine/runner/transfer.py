"""Host <-> device copies that never make the host wait for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes
the stream: the host waits for every kernel queued before it, which ends any overlap of
host work (scheduling, input building, detokenizing) with the device. Staging through
pinned memory and copying with ``non_blocking=True`` only queues the copy; torch's pinned
allocator keeps the staging block until the copy has run. The way back is the same: a
non-blocking copy into pinned memory and an event to wait on when the values are needed.
On a CPU every copy is immediate and these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D (or nested) list as a tensor on ``device``, queued without a host sync."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return tensor  # already there (``.to`` would return it, through the dispatcher)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class ReadBack:
    """A device tensor on its way to host memory; ``wait()`` returns it once it is there."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)  # queued on the tensor's device's stream
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensor.device))

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
