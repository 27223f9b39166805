"""The engine's side of multi-LoRA: turning it on from the config, and a request's
adapter from its name.

Kept out of ``engine.py`` so the engine only calls two functions; the adapters
themselves are managed through ``engine.lora`` (a ``LoraManager``: ``add_adapter``,
``remove_adapter``, ``adapters``), or ``None`` when LoRA is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.lora.adapter import LoraAdapter, LoraError
from worker.engine.lora.gate import AdapterGate

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.lora.manager import LoraManager
    from worker.engine.runner.model_runner import ModelRunner
    from worker.engine.sched.scheduler import Scheduler


class UnknownAdapter(ValueError):
    """A request named an adapter that cannot run: not loaded, not its tenant's, or its
    files unreadable. ``code`` is the error code its terminal event carries; the message
    never holds a path."""

    def __init__(self, message: str, code: str = "model_not_found") -> None:
        super().__init__(message)
        self.code = code


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
    except LoraError as exc:  # pushed out of the host cache, and its files changed since
        raise UnknownAdapter(f"LoRA adapter {name!r} cannot be read again: {exc}",
                             "adapter_unavailable") from None
    except KeyError:
        loaded = manager.adapters()
        shown = ", ".join(loaded[:8]) + (f", … ({len(loaded)} in all)" if len(loaded) > 8
                                         else "")
        raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded "
                             f"(loaded: {shown or 'none'})") from None
