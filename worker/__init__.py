"""Ferry's inference worker: continuous-batching engine over a paged KV cache.

Names are resolved lazily so that torch-free modules of this package
(``worker.service.metrics.prometheus``)
can be imported without loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol.sampling import SamplingParams
    from worker.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine.engine import Engine
    from worker.engine.engine_stats import EngineStats
    from worker.engine.llm import LLM
    from worker.engine.output.outputs import CompletionOutput, TextOutput

_EXPORTS = {
    "LLM": "worker.engine.llm",
    "Engine": "worker.engine.engine",
    "EngineConfig": "worker.engine.config",
    "ModelConfig": "worker.engine.config",
    "CacheConfig": "worker.engine.config",
    "SchedulerConfig": "worker.engine.config",
    "CompletionOutput": "worker.engine.output.outputs",
    "EngineStats": "worker.engine.engine_stats",
    "TextOutput": "worker.engine.output.outputs",
    "SamplingParams": "protocol.sampling",
}
__all__ = [
    "LLM", "CacheConfig", "CompletionOutput", "Engine", "EngineConfig", "EngineStats",
    "ModelConfig", "SamplingParams", "SchedulerConfig", "TextOutput",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
