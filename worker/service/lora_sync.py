"""This worker's LoRA adapters kept equal to the fleet's registry (``protocol/lora.py``).

A thread of its own reads the registry hash at start and every ``interval_s``; an adapter
that appeared is read from disk and checked there (``LoraManager.load``: file reads and
host tensors), so loading never stalls the step loop; one that left is dropped. The loop
applies the changes (``apply``: dictionary updates) between steps. The adapters a worker
starts with (``FERRY_LORA_MODULES``) are added to the registry on the first pass, so the
rest of the fleet serves them too.

A request whose ``model`` names an adapter this worker has not picked up yet (registered a
moment ago) is looked up in the registry at once and loaded on the loop: once per
adapter, only in that race. A name that is neither the served model nor a registered
adapter runs on the base model, as before adapters existed (the gateway 404s names it
does not serve; direct producers may put any label in ``model``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import structlog

from protocol.lora import LoraRecord, read_adapters, register_adapter
from worker.engine.lora.adapter import LoraAdapter, LoraError
from worker.engine.lora.engine_hooks import UnknownAdapter
from worker.engine.lora.manager import LoraManager
from worker.service.redis_io import TRANSIENT_ERRORS, Backoff, WorkerSettings, recover

log = structlog.get_logger("ferry.worker.lora")


class LoraSync:
    """``start()``/``stop()`` the sync thread; ``apply()`` and ``adapter_for()`` on the
    engine loop. With LoRA off (``manager`` None) the thread never starts and every
    request runs on the base model."""

    def __init__(self, settings: WorkerSettings, manager: LoraManager | None,
                 modules: tuple[tuple[str, str], ...] = (), interval_s: float = 2.0) -> None:
        self.settings = settings
        self.manager = manager
        self.model = settings.model_name
        self.interval_s = interval_s
        self._modules = modules
        self._changes: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._paths: dict[str, str] = {}  # sync thread: the adapters loaded or queued
        self._failed: dict[str, str] = {}  # name -> path that failed (logged once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferry-lora-sync", daemon=True)
        self._loop_redis: Any = None  # the engine loop's own client (a registry miss)
        self._misses: dict[str, float] = {}  # label -> when the registry lacked it
        # the loaded names, comma-joined: written by the loop, read by the heartbeat thread
        self.names = ",".join(manager.adapters()) if manager is not None else ""
        self.metrics: Any = None  # LoraMetrics: its gauge follows ``names``

    def start(self) -> None:
        if self.manager is not None:
            self._paths = {name: path for name, path in self._modules}
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    # -- the sync thread -----------------------------------------------------------------
    def _run(self) -> None:
        backoff, r, published = Backoff(cap=5.0), None, False
        while not self._stop.is_set():
            try:
                r = r or self.settings.connect()
                if not published:
                    self._publish_modules(r)
                    published = True
                self.reconcile(read_adapters(r, self.settings.keys, self.model))
                backoff.reset()
            except TRANSIENT_ERRORS as exc:
                log.warning("lora_registry_unavailable", error=str(exc))
                if r is not None:
                    recover(r)
                backoff.wait(self._stop)
                continue
            self._stop.wait(self.interval_s)
        if r is not None:
            r.close()

    def _publish_modules(self, r: Any) -> None:
        for name, path in self._modules:
            register_adapter(r, self.settings.keys, LoraRecord(name=name, path=path,
                                                               parent=self.model))

    def reconcile(self, records: dict[str, LoraRecord]) -> None:
        """Queue the loads and drops that make this worker's adapters equal ``records``."""
        assert self.manager is not None
        for name, record in records.items():
            if self._paths.get(name) == record.path or self._failed.get(name) == record.path:
                continue
            try:
                adapter = self.manager.load(name, record.path)
            except LoraError as exc:  # e.g. a path this worker's volume does not have
                self._failed[name] = record.path
                log.error("lora_adapter_load_failed", adapter=name, path=record.path,
                          error=str(exc))
                continue
            if name in self._paths:  # registered again with another path
                self._changes.put(("remove", name))
            self._paths[name] = record.path
            self._changes.put(("add", adapter))
        for name in [n for n in self._paths if n not in records]:
            del self._paths[name]
            self._changes.put(("remove", name))

    # -- the engine loop -----------------------------------------------------------------
    def apply(self) -> None:
        """Install and drop what the sync thread prepared."""
        if self.manager is None:
            return
        changed, deferred = False, []
        while True:
            try:
                kind, value = self._changes.get_nowait()
            except queue.Empty:
                break
            changed = True
            if kind == "remove":
                self.manager.remove_adapter(value)
                log.info("lora_adapter_unloaded", adapter=value)
            elif not self._install(value):
                deferred.append(value)
        for adapter in deferred:  # tried again after the next step
            self._changes.put(("add", adapter))
        if changed:
            self._loaded_changed()

    def _loaded_changed(self) -> None:
        assert self.manager is not None
        self.names = ",".join(self.manager.adapters())
        if self.metrics is not None:
            self.metrics.loaded.set(len(self.manager.adapters()))

    def _install(self, adapter: LoraAdapter) -> bool:
        """False: not yet (its previous weights still serve running requests)."""
        assert self.manager is not None
        if self.manager.cache.paths.get(adapter.name) == adapter.path:
            return True  # a request loaded it meanwhile (``adapter_for``)
        try:
            self.manager.install(adapter)
        except LoraError as exc:
            log.warning("lora_adapter_install_deferred", adapter=adapter.name, error=str(exc))
            return False
        log.info("lora_adapter_loaded", adapter=adapter.name, path=adapter.path,
                 rank=adapter.rank)
        return True

    def adapter_for(self, model: str | None) -> LoraAdapter | None:
        """The adapter a request's ``model`` names (None: the base model); raises
        ``UnknownAdapter`` when it names a registered adapter that cannot run here."""
        if model is None or model == self.model:
            return None
        if self.manager is not None:
            self.apply()
            if model in self.manager.cache.paths:
                return self.manager.adapter(model)
        record = self._registered(model)
        if record is None:
            return None  # a label, not an adapter: the base model
        if self.manager is None:
            raise UnknownAdapter(f"model: LoRA adapter {model!r} cannot run on this worker: "
                                 "LoRA is not enabled (FERRY_ENABLE_LORA=1)")
        try:
            adapter = self.manager.install(self.manager.load(model, record.path))
        except LoraError as exc:
            raise UnknownAdapter(f"model: {exc}") from exc
        log.info("lora_adapter_loaded", adapter=model, path=record.path, on_request=True)
        self._loaded_changed()
        return adapter

    def _registered(self, model: str) -> LoraRecord | None:
        """The registry's record of ``model``; a label it lacked is not asked again for
        ``interval_s`` (one round trip per label, not per request)."""
        now = time.monotonic()
        if now - self._misses.get(model, float("-inf")) < self.interval_s:
            return None
        try:
            self._loop_redis = self._loop_redis or self.settings.connect()
            record = read_adapters(self._loop_redis, self.settings.keys, self.model).get(model)
        except TRANSIENT_ERRORS:
            return None  # Redis away: the base model, as for any label
        if record is None:
            if len(self._misses) > 1024:
                self._misses.clear()
            self._misses[model] = now
        return record

    def loaded(self) -> list[str]:
        return self.manager.adapters() if self.manager is not None else []
