"""Tensor parallelism in the paged runner: rank 0 leads, ranks 1..N-1 follow.

Rank 0 (the engine's process) spawns ranks 1..N-1 (``torch.multiprocessing``, spawn),
joins the group with them, and before each forward broadcasts that step's flattened
inputs (ids, positions, attention metadata, the rows that sample). Each follower builds
its own ``ModelRunner`` on its shards, with its own KV pool of its heads and the same
block numbering, and runs exactly the steps rank 0 runs: the scheduler, the block tables
and sampling exist on rank 0 alone.

The followers' side is ``tp_follower.py``. A follower that exits is seen by ``check``
(the service calls it every loop turn), one that hangs by the group's collective
timeout; either way rank 0 raises ``TensorParallelFault``, a ``DeviceFault``: the worker
hands its requests back and exits, and another worker resumes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import structlog
import torch

from worker.engine.config import CacheConfig, ModelConfig
from worker.engine.distributed.driver import spawn_followers, stop_followers
from worker.engine.distributed.group import GroupSpec, broadcast_object, close_group, init_group
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.health import DeviceFault
from worker.engine.lora.config import LoraConfig
from worker.engine.runner.attention.metadata import AttentionMetadata

_log = structlog.get_logger("ferry.worker.tp")


STEP_LIMIT = 4  # a step longer than this many collective timeouts: the group is hung


class TensorParallelFault(DeviceFault):
    """A rank of this worker's group died, hung or failed a step: the worker must end."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its runner from (rank 0's settings, picklable)."""

    model: ModelConfig
    cache: CacheConfig
    max_num_seqs: int
    size: int
    group: GroupSpec
    threads: int  # CPU: torch threads per rank (the host's cores shared by the ranks)
    lora: LoraConfig | None = None  # multi-LoRA on: every rank wraps its projections

    def model_for(self, rank: int) -> ModelConfig:
        """Rank ``rank``'s model settings: on CUDA, device ``cuda:rank``."""
        if self.model.device.startswith("cuda") or (
                self.model.device == "auto" and torch.cuda.is_available()):
            return dataclasses.replace(self.model, device=f"cuda:{rank}")
        return self.model


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.cpu() if t.device.type != "cpu" else t


def step_message(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_rows: torch.Tensor) -> tuple[Any, ...]:
    """One step's inputs as host tensors, for the broadcast."""
    fields = {f.name: _cpu(v) if isinstance(v := getattr(meta, f.name), torch.Tensor) else v
              for f in dataclasses.fields(meta)}
    return _cpu(ids), _cpu(positions), fields, _cpu(sample_rows)


def open_message(message: tuple[Any, ...], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A broadcast step's inputs on this rank's device."""
    ids, positions, fields, sample_rows = message
    moved: dict[str, Any] = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                             for k, v in fields.items()}
    meta = AttentionMetadata(**moved)
    return ids.to(device), positions.to(device), meta, sample_rows.to(device)


class RankLead:
    """Rank 0's side: the followers' processes, each step's broadcast, their health."""

    def __init__(self, spec: RankSpec, procs: list[BaseProcess], rendezvous: str) -> None:
        self.spec = spec
        self.procs = procs
        self._rendezvous = rendezvous
        self._closed = False
        self._threads = torch.get_num_threads()
        self._step_since: float | None = None  # when the step in flight began
        self._hung = ""  # set by the watchdog: why it ended the followers
        threading.Thread(target=self._watch, name="ferry-tp-watchdog", daemon=True).start()

    @classmethod
    def start(cls, target: Callable[[int, RankSpec], None], model: ModelConfig,
              cache: CacheConfig, max_num_seqs: int, size: int,
              timeout_s: float = 30.0, lora: LoraConfig | None = None) -> RankLead:
        """Spawn ranks 1..size-1 as ``target(rank, spec)`` and join the group as rank 0."""
        rendezvous = tempfile.mkdtemp(prefix="ferry-tp-")
        spec = RankSpec(model, cache, max_num_seqs, size,
                        GroupSpec(f"file://{rendezvous}/group", timeout_s),
                        max(1, torch.get_num_threads() // size), lora=lora)
        procs = spawn_followers(size, target, (spec,))
        lead = cls(spec, procs, rendezvous)
        device = "cuda" if spec.model_for(0).device.startswith("cuda") else "cpu"
        if device == "cpu":
            torch.set_num_threads(spec.threads)
        init_group(TPConfig(size, 0), spec.group, device)
        _log.info("tensor_parallel_started", size=size, backend=device,
                  follower_pids=[p.pid for p in procs], timeout_s=timeout_s)
        return lead

    def send(self, message: object) -> None:
        """Hand the followers this step's inputs (they run it as rank 0 does)."""
        broadcast_object(message)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A step the followers wait on: any failure in it ends the whole group."""
        self._step_since = time.monotonic()
        try:
            yield
        except TensorParallelFault:
            raise
        except Exception as exc:
            raise self.fault(self._hung or f"step failed: {type(exc).__name__}: {exc}") \
                from exc
        finally:
            self._step_since = None

    def _watch(self) -> None:
        """A step in flight for ``STEP_LIMIT`` collective timeouts is a hung rank that the
        collectives did not catch (a stopped peer can leave a gloo send waiting): kill
        the followers, so rank 0's collective fails on their closed connections."""
        limit = STEP_LIMIT * self.spec.group.timeout_s
        while not self._closed:
            since = self._step_since
            if since is not None and time.monotonic() - since > limit:
                self._hung = f"a step hung for more than {limit:.0f} s"
                for proc in self.procs:
                    if proc.is_alive():
                        proc.kill()
                return
            time.sleep(0.2)

    def check(self) -> None:
        """Raise ``TensorParallelFault`` if a follower has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            if not self._closed and not proc.is_alive():
                raise self.fault(f"rank {rank} (pid {proc.pid}) exited with code "
                                 f"{proc.exitcode}")

    def fault(self, reason: str) -> TensorParallelFault:
        """The worker's end: log it once, stop every follower, return the fault to raise."""
        if not self._closed:
            _log.error("tensor_parallel_rank_lost", reason=reason, size=self.spec.size)
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
            self._finish()
        return TensorParallelFault(f"tensor-parallel group of {self.spec.size} lost: {reason}")

    def close(self) -> None:
        """End the followers' loops, wait for them and leave the group."""
        if self._closed:
            return
        try:
            stop_followers()
        except Exception as exc:  # a follower already gone: nothing more to tell it
            _log.warning("tensor_parallel_stop_failed", error=str(exc))
        for proc in self.procs:
            proc.join(timeout=self.spec.group.timeout_s)
            if proc.is_alive():
                proc.kill()
        self._finish()

    def _finish(self) -> None:
        self._closed = True
        close_group()
        torch.set_num_threads(self._threads)
        shutil.rmtree(self._rendezvous, ignore_errors=True)
