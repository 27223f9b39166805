"""The inference engine: everything one ``Engine.step()`` uses, and no I/O.

Rooms: ``sched/`` (the scheduler, its batch rows and the schedule's output), ``kv/`` (the
paged KV cache's bookkeeping and its host tier), ``runner/`` (the model runner, attention
backends and the CPU path), ``sample/`` (the sampler and its per-row constants),
``structured/`` (grammars), ``inputs/`` (prompts), ``output/`` (the step's token batch and
its text: torch-free, it runs in the output process), ``speculative/`` and ``lora/``;
``engine.Engine`` ties them together and ``llm.LLM`` is the offline API. Nothing here
imports ``worker.service`` (the Redis process around the engine).

The names below are the engine's public API: ``worker.service`` imports the engine only
through them (``tests/test_layout.py``). They resolve lazily, so importing this package
loads nothing heavy: torch comes in with the modules that need it, and the output process
reaches the torch-free output names without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.engine_stats import EngineStats
    from worker.engine.health import DEGRADED_REASONS, DeviceFault
    from worker.engine.inputs.prompts import PromptBuilder, PromptError, PromptOptions
    from worker.engine.lora.adapter import LoraAdapter, LoraError
    from worker.engine.lora.engine_hooks import UnknownAdapter
    from worker.engine.lora.manager import LoraManager
    from worker.engine.output.outputs import TextOutput
    from worker.engine.output.rust_decode import RustDecoder, decode_spec, text_decoder
    from worker.engine.output.step_batch import EngineEnd, StepBatch, StreamOpen
    from worker.engine.output.text_output import StreamTexts, TextOutputs
    from worker.engine.speculative.draft_store import DraftStore

_EXPORTS = {
    "Engine": "worker.engine.engine",
    "EngineConfig": "worker.engine.config",
    "EngineStats": "worker.engine.engine_stats",
    "DeviceFault": "worker.engine.health",
    "DEGRADED_REASONS": "worker.engine.health",
    "StepBatch": "worker.engine.output.step_batch",
    "EngineEnd": "worker.engine.output.step_batch",
    "StreamOpen": "worker.engine.output.step_batch",
    "TextOutput": "worker.engine.output.outputs",
    "StreamTexts": "worker.engine.output.text_output",
    "TextOutputs": "worker.engine.output.text_output",
    "RustDecoder": "worker.engine.output.rust_decode",
    "decode_spec": "worker.engine.output.rust_decode",
    "text_decoder": "worker.engine.output.rust_decode",
    "PromptBuilder": "worker.engine.inputs.prompts",
    "PromptError": "worker.engine.inputs.prompts",
    "PromptOptions": "worker.engine.inputs.prompts",
    "LoraManager": "worker.engine.lora.manager",
    "LoraAdapter": "worker.engine.lora.adapter",
    "LoraError": "worker.engine.lora.adapter",
    "UnknownAdapter": "worker.engine.lora.engine_hooks",
    "DraftStore": "worker.engine.speculative.draft_store",
}
__all__ = [
    "DEGRADED_REASONS", "DeviceFault", "DraftStore", "Engine", "EngineConfig", "EngineEnd",
    "EngineStats", "LoraAdapter", "LoraError", "LoraManager", "PromptBuilder", "PromptError",
    "PromptOptions", "RustDecoder", "StepBatch", "TextOutput", "StreamOpen", "StreamTexts",
    "TextOutputs", "UnknownAdapter", "decode_spec", "text_decoder",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
