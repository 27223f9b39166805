"""This worker's LoRA adapters kept equal to the fleet's registry (``protocol/lora/registry.py``).

A thread of its own reads the registry hash at start and every ``interval_s``; an adapter
that appeared (or was registered again: another version) is read from disk and checked
there (``LoraManager.load``: file reads and host tensors), so loading never stalls the step
loop; one that left is dropped. The loop applies the changes (``apply``: dictionary
updates) between steps; a new version replaces the old one at once for new requests while
the old one finishes its running rows (``LoraManager.install``). The adapters a worker
starts with (``FERRY_LORA_MODULES``) are added to the registry on the first pass, so the
rest of the fleet serves them too.

Paths: a record registered at run time (``source`` ``api`` or ``dir``) is read only from
inside this worker's adapter roots, resolved first (``protocol/lora/paths.py``); records of
a worker's command line (``modules``) are the operator's own. The thread survives any
entry: one that fails (a path outside the roots, a file that breaks the loader in any
way) is logged once per registration and skipped, and the adapters registered after it
are still loaded.

A request whose ``model`` names an adapter this worker has not picked up yet (registered a
moment ago) is looked up in the registry at once and loaded on the loop: once per
adapter, only in that race. A name that is neither the served model nor a registered
adapter runs on the base model (the gateway 404s names it
does not serve; direct producers may put any label in ``model``). A request naming
another tenant's adapter (``{other}::name``) is refused whatever the registry holds: no
producer runs another's adapter, nor learns whether it exists.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import structlog

from protocol.lora.paths import confine
from protocol.lora.registry import LoraRecord, public_name, read_adapters, register_adapter
from protocol.tenants.ids import DEFAULT_TENANT, SEPARATOR, tenant_of_id
from worker.engine import LoraAdapter, LoraManager, UnknownAdapter
from worker.service.redis.connection import TRANSIENT_ERRORS, Backoff, WorkerSettings, recover
from worker.service.sidecars.lora_errors import Failure, reason_of, unavailable

log = structlog.get_logger("ferry.worker.lora")

HEARTBEAT_NAMES = 16
"""Adapter names a heartbeat lists (``lora_adapters``); ``lora_adapters_loaded`` counts all."""
RETRY_S = 30.0
"""A registration that failed to load is tried again after this long (the files may have
come back); until then its requests get the failure at once, without reading files."""


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
        self._modules = dict(modules)
        if manager is not None:
            manager.roots = settings.lora_roots  # check_lora reads them too
        self._changes: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._versions: dict[str, str] = {}  # sync thread: the registrations loaded or queued
        # name -> the registration that failed to load, why and when (both threads write
        # single entries; a request finds the reason here instead of reading files again)
        self._failed: dict[str, Failure] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferry-lora-sync", daemon=True)
        self._loop_redis: Any = None  # the engine loop's own client (a registry miss)
        self._misses: dict[str, float] = {}  # label -> when the registry lacked it
        # written by the loop, read by the heartbeat thread (one assignment: atomic)
        self.heartbeat: dict[str, str | int] = {}
        self.metrics: Any = None  # LoraMetrics: its gauge follows the loaded count
        if manager is not None:
            self._loaded_changed()

    @property
    def names(self) -> str:
        """The loaded adapters the heartbeat lists (at most ``HEARTBEAT_NAMES``)."""
        return str(self.heartbeat.get("lora_adapters", ""))

    def start(self) -> None:
        if self.manager is not None:
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
            except Exception:  # a bug must not end the sync for good: log, retry later
                log.exception("lora_sync_pass_failed")
                backoff.wait(self._stop)
                continue
            self._stop.wait(self.interval_s)
        if r is not None:
            r.close()

    def _publish_modules(self, r: Any) -> None:
        for name, path in self._modules.items():
            register_adapter(r, self.settings.keys, LoraRecord(
                name=name, path=path, parent=self.model, source="modules"))

    def reconcile(self, records: dict[str, LoraRecord]) -> None:
        """Queue the loads and drops that make this worker's adapters equal ``records``;
        an entry that cannot be loaded is logged once per registration, skipped, and tried
        again every ``RETRY_S``."""
        assert self.manager is not None
        for name, record in records.items():
            version = record.version
            if self._versions.get(name) == version or self._failing(name, version):
                continue
            if name not in self._versions and self._modules.get(name) == record.path:
                self._versions[name] = version  # installed at start from the command line
                continue
            try:
                adapter = self._read(name, record)
            except Exception as exc:  # any entry at all: the thread goes on
                self._failure(name, version, exc, record.path)
                continue
            self._failed.pop(name, None)
            self._versions[name] = version
            self._changes.put(("add", (adapter, version)))
        for name in [n for n in self._versions if n not in records]:
            del self._versions[name]
            self._changes.put(("remove", name))
        for name in [n for n in list(self._failed) if n not in records]:
            self._failed.pop(name, None)

    def _failing(self, name: str, version: str) -> Failure | None:
        """The recent failure of registration ``version`` of ``name``, if any."""
        failed = self._failed.get(name)
        if failed is None or failed.version != version:
            return None
        return failed if time.monotonic() - failed.at < RETRY_S else None

    def _failure(self, name: str, version: str, exc: BaseException, path: str) -> Failure:
        """Remember why ``name`` failed (logged the first time for a registration)."""
        reason = reason_of(exc, path)
        previous = self._failed.get(name)
        if previous is None or previous.version != version:
            log.error("lora_adapter_load_failed", adapter=name, error=reason)
        failed = Failure(version, reason, time.monotonic())
        self._failed[name] = failed
        return failed

    def _read(self, name: str, record: LoraRecord) -> LoraAdapter:
        """Load ``record``'s files, from inside the roots unless the operator's command
        line registered it."""
        assert self.manager is not None
        path = record.path
        if record.source != "modules":
            path = confine(path, self.settings.lora_roots)
        return self.manager.load(name, path)

    # -- the engine loop -----------------------------------------------------------------
    def apply(self) -> None:
        """Install and drop what the sync thread prepared (LoRA on: ``manager`` set)."""
        assert self.manager is not None
        changed = False
        while True:
            try:
                kind, value = self._changes.get_nowait()
            except queue.Empty:
                break
            changed = True
            try:
                if kind == "remove":
                    self.manager.remove_adapter(value)
                    log.info("lora_adapter_unloaded", adapter=value)
                else:
                    self._install(*value)
            except Exception:  # the loop must go on serving whatever one change does
                log.exception("lora_adapter_change_failed", change=kind)
        if changed:
            self._loaded_changed()

    def _loaded_changed(self) -> None:
        assert self.manager is not None
        loaded = self.manager.adapters()
        self.heartbeat = {"lora_adapters": ",".join(loaded[:HEARTBEAT_NAMES]),
                          "lora_adapters_loaded": len(loaded)}
        if self.metrics is not None:
            self.metrics.loaded.set(len(loaded))

    def _install(self, adapter: LoraAdapter, version: str) -> None:
        """Install registration ``version`` of ``adapter``'s name unless it is already (a
        request loaded it meanwhile, ``adapter_for``)."""
        assert self.manager is not None
        if self.manager.cache.registrations.get(adapter.name) == version:
            return
        self.manager.install(adapter, version)
        log.info("lora_adapter_loaded", adapter=adapter.name, rank=adapter.rank)

    def adapter_for(self, model: str | None, tenant: str | None = None) -> LoraAdapter | None:
        """The adapter a request of ``tenant`` names in ``model`` (None: the base model);
        raises ``UnknownAdapter`` when it names another tenant's adapter, or a registered
        one that cannot run here (the message holds no path)."""
        if model is None or model == self.model:
            return None
        if SEPARATOR in model and tenant_of_id(model) != (tenant or DEFAULT_TENANT):
            raise UnknownAdapter(f"model: the model {model!r} does not exist")
        shown = public_name(tenant, model)
        if self.manager is not None:
            self.apply()
            if model in self.manager.cache.paths:
                return self._cached(model, shown)
        record = self._registered(model)
        if record is None:
            return None  # a label, not an adapter: the base model
        if self.manager is None:
            raise UnknownAdapter(f"model: LoRA adapter {shown!r} cannot run on this worker: "
                                 "LoRA is not enabled (FERRY_ENABLE_LORA=1)", "lora_disabled")
        failed = self._failing(model, record.version)
        if failed is None:
            try:
                self._install(self._read(model, record), record.version)
            except Exception as exc:
                failed = self._failure(model, record.version, exc, record.path)
        if failed is not None:
            raise unavailable(model, shown, failed.reason)
        self._loaded_changed()
        return self._cached(model, shown)

    def _cached(self, model: str, shown: str) -> LoraAdapter:
        """An installed adapter's weights (read from its files again if the host cache let
        them go, which fails once they are gone)."""
        assert self.manager is not None
        try:
            return self.manager.adapter(model)
        except Exception as exc:
            reason = reason_of(exc, self.manager.cache.paths.get(model))
            raise unavailable(model, shown, reason) from None

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
