"""A worker on ``cuda:N`` makes N the current device once, at load.

Triton launches on the current device and streams and events default to it, so a worker
on ``cuda:1`` that left device 0 current would launch kernels there with device 1's
pointers and read tokens back before they arrive. No GPU here: the CUDA calls are
stand-ins that record what they were asked (the runtime part waits for a device run).
"""

from __future__ import annotations

import pytest
import torch

from worker.engine.runner.model_loader import resolve_device


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made_current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def test_the_configured_index_becomes_current(two_gpus: list[int]) -> None:
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert two_gpus == [1]


def test_plain_cuda_names_the_current_index(two_gpus: list[int]) -> None:
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert two_gpus == [0, 0]


def test_an_index_past_the_devices_is_refused(two_gpus: list[int]) -> None:
    with pytest.raises(ValueError, match="cuda:2.*only 2 CUDA devices"):
        resolve_device("cuda:2")
    assert two_gpus == []


def test_a_cpu_device_touches_no_cuda_state(two_gpus: list[int]) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert two_gpus == []
