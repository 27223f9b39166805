"""Registered adapters by name, and the loaded ones kept in host memory (LRU).

Registering loads and checks the adapter at once, so a bad adapter is refused when it
is registered (a clear ``LoraError``) and never at a request's first step. The host copy
is what a device slot is filled from; an adapter pushed out of this cache is read from
its path again when next needed.

Each installation is a new version with a prefix-cache key of its own (name, path and a
registration number), also when the name was installed before: KV computed under one
version is never reused by another, and the device slots hold versions apart
(``slots.py``). ``registrations`` remembers which fleet registration each name was
installed from (``protocol/lora/registry.py``'s ``LoraRecord.version``), so the LoRA sync installs
each registration once.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict

from worker.engine.lora.adapter import LoraAdapter, LoraError, load_adapter
from worker.engine.lora.config import LoraConfig
from worker.engine.lora.targets import BaseTargets


class AdapterCache:
    def __init__(self, targets: BaseTargets, cfg: LoraConfig) -> None:
        self.targets = targets
        self.cfg = cfg
        self.paths: dict[str, str] = {}  # every registered adapter
        self.keys: dict[str, str] = {}  # its prefix-cache key (LoraAdapter.cache_key)
        self.registrations: dict[str, str] = {}  # the fleet registration it came from
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._registrations = itertools.count(1)

    def register(self, name: str, path: str) -> LoraAdapter:
        """Load and check ``path`` as adapter ``name``; raises ``LoraError``."""
        return self.install(self.load(name, path))

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter without registering it (any thread: file reads and
        host tensors only); raises ``LoraError``."""
        if not name:
            raise LoraError("a LoRA adapter needs a name")
        return load_adapter(name, path, self.targets, self.cfg.max_lora_rank)

    def install(self, adapter: LoraAdapter, registration: str = "") -> LoraAdapter:
        """Register an adapter ``load`` returned (a new version of its name, replacing any
        installed one); it gets its prefix-cache key here."""
        name, path = adapter.name, adapter.path
        key = f"{name}|{path}|{next(self._registrations)}"
        adapter = dataclasses.replace(adapter, cache_key=key)
        self.paths[name] = path
        self.keys[name] = key
        self.registrations[name] = registration
        self._loaded.pop(name, None)
        self._keep(adapter)
        return adapter

    def unregister(self, name: str) -> None:
        self.paths.pop(name, None)
        self.keys.pop(name, None)
        self.registrations.pop(name, None)
        self._loaded.pop(name, None)

    def is_current(self, key: str) -> bool:
        """Whether version ``key`` (a prefix-cache key) is the installed one of its name."""
        return self.keys.get(key.partition("|")[0]) == key

    def get(self, name: str) -> LoraAdapter:
        """The loaded adapter ``name`` (read again from its path if it was pushed out)."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            return adapter
        path = self.paths.get(name)
        if path is None:
            raise KeyError(f"unknown LoRA adapter {name!r}")
        adapter = load_adapter(name, path, self.targets, self.cfg.max_lora_rank)
        adapter = dataclasses.replace(adapter, cache_key=self.keys[name])
        self._keep(adapter)
        return adapter

    def loaded(self) -> list[str]:
        return list(self._loaded)

    def _keep(self, adapter: LoraAdapter) -> None:
        self._loaded[adapter.name] = adapter
        self._loaded.move_to_end(adapter.name)
        while len(self._loaded) > self.cfg.max_cpu_loras:
            self._loaded.popitem(last=False)
