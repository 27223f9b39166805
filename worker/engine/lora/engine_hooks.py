"""The engine's side of multi-LoRA: turning it on from the config, and a request's
adapter from its name.

Kept out of ``engine.py`` so the engine only calls two functions; the adapters
themselves are managed through ``engine.lora`` (a ``LoraManager``: ``add_adapter``,
``remove_adapter``, ``adapters``), or ``None`` when LoRA is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.lora.adapter import LoraAdapter
from worker.engine.lora.gate import AdapterGate

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.lora.manager import LoraManager
    from worker.engine.model_runner import ModelRunner
    from worker.engine.scheduler import Scheduler


class UnknownAdapter(ValueError):
    """A request named an adapter that is not loaded (the gateway answers 404)."""


def enable_lora(runner: ModelRunner, scheduler: Scheduler,
                config: EngineConfig) -> LoraManager | None:
    """Wrap the model for LoRA and register ``config.lora_modules`` when LoRA is on; a bad
    adapter among them raises ``LoraError`` (a worker must not start half-configured)."""
    if config.lora is None:
        return None
    manager = runner.enable_lora(config.lora)
    for name, path in config.lora_modules:
        manager.add_adapter(name, path)
    scheduler.adapters = AdapterGate(manager)
    return manager


def adapter_for(manager: LoraManager | None, name: str | None) -> LoraAdapter | None:
    """The host weights a request named ``name`` runs with (None: the base model)."""
    if name is None:
        return None
    if manager is None:
        raise UnknownAdapter(f"LoRA adapter {name!r}: LoRA is not enabled on this worker "
                             "(FERRY_ENABLE_LORA=1 or FERRY_LORA_MODULES)")
    try:
        return manager.adapter(name)
    except KeyError:
        raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded "
                             f"(loaded: {', '.join(manager.adapters()) or 'none'})") from None
