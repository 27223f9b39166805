"""``python -m tests.worker.service.faulty_worker worker ...``: the real ``ferry worker``
command, except that after ``FERRY_TEST_FAULT_AFTER_STEPS`` forwards every forward raises
the error torch raises when a CUDA context is broken (an illegal memory access). There is
no GPU here; the fault is the only simulated part: the process, its engine, its Redis I/O
and its exit are the production ones.
"""

from __future__ import annotations

import os

import torch

from ferry.cli import main
from worker.engine.runner.model_runner import ModelRunner

_AFTER = int(os.environ["FERRY_TEST_FAULT_AFTER_STEPS"])
_execute = ModelRunner.execute
_calls = [0]


def _faulty_execute(self: ModelRunner, *args: object, **kwargs: object) -> torch.Tensor:
    _calls[0] += 1
    if _calls[0] > _AFTER:
        raise torch.AcceleratorError(
            "CUDA error: an illegal memory access was encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call "
            "(simulated)")
    return _execute(self, *args, **kwargs)  # type: ignore[arg-type]


ModelRunner.execute = _faulty_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
