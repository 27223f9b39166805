"""Ferry's inference worker: continuous-batching engine over a paged KV cache.

Names are resolved lazily so that torch-free modules of this package (``worker.metrics``)
can be imported without loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol.sampling import SamplingParams
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine import Engine
    from worker.llm import LLM
    from worker.outputs import CompletionOutput, EngineStats, StepOutput

_EXPORTS = {
    "LLM": "worker.llm",
    "Engine": "worker.engine",
    "EngineConfig": "worker.config",
    "ModelConfig": "worker.config",
    "CacheConfig": "worker.config",
    "SchedulerConfig": "worker.config",
    "CompletionOutput": "worker.outputs",
    "EngineStats": "worker.outputs",
    "StepOutput": "worker.outputs",
    "SamplingParams": "protocol.sampling",
}
__all__ = [
    "LLM", "CacheConfig", "CompletionOutput", "Engine", "EngineConfig", "EngineStats",
    "ModelConfig", "SamplingParams", "SchedulerConfig", "StepOutput",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
