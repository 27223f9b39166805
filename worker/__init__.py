"""Ferry's inference worker: continuous-batching engine over a paged KV cache."""

from protocol.sampling import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine import Engine
from worker.llm import LLM
from worker.outputs import CompletionOutput, EngineStats, StepOutput

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "SamplingParams",
    "SchedulerConfig",
    "StepOutput",
]
