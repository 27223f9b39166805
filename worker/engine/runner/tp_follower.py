"""A follower rank of a tensor-parallel worker, and rank 0's start of them.

``follower_main`` runs in each spawned process: it builds a ``ModelRunner`` on this
rank's shards (its KV heads, rank 0's block numbering) and runs each step rank 0
broadcasts until told to stop (``tp_ranks.py`` is rank 0's side); ``follow_step`` is what
one broadcast message does on a follower.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

import structlog
import torch

from worker.engine.config import EngineConfig
from worker.engine.distributed.driver import follower_loop
from worker.engine.distributed.group import close_group, init_group
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.kv.tier_mirror import HostCopies
from worker.engine.lora.tp_sync import LoraStepSync
from worker.engine.runner.cpu.step_threads import serial_if
from worker.engine.runner.model_runner import ModelRunner
from worker.engine.runner.tp_checks import check_tensor_parallel
from worker.engine.runner.tp_ranks import RankLead, RankSpec, open_message

_log = structlog.get_logger("ferry.worker.tp")


def start_ranks(config: EngineConfig) -> RankLead | None:
    """Rank 0's followers for ``config`` (None at size 1), after every start-up refusal."""
    if config.tensor_parallel_size == 1:
        return None
    check_tensor_parallel(config)
    return RankLead.start(follower_main, config.model, config.cache,
                          config.scheduler.max_num_seqs, config.tensor_parallel_size,
                          config.tensor_parallel_timeout_s, lora=config.lora)


def _follow_the_leader() -> None:
    """A follower ignores Ctrl-C (rank 0 ends it) and, on Linux, dies with rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # else the collective timeout
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@torch.inference_mode()
def follow_step(runner: ModelRunner, message: object) -> None:
    """Run one message rank 0 broadcast, on this rank's shards (on one thread where rank 0
    runs it on one, ``step_threads.py``). A step with adapter rows comes after its
    adapters' message (``lora/tp_sync.py``), a step with host-tier copies after those
    copies (``kv/tier_mirror.py``)."""
    if isinstance(message, LoraStepSync):
        assert runner.lora is not None, "rank 0 runs LoRA, this rank was built without"
        runner.lora.follow(message)
        return
    if isinstance(message, HostCopies):
        runner.tier_mirror.replay(message, runner.kv_pool)
        return
    assert isinstance(message, tuple), f"not a step message: {type(message).__name__}"
    ids, positions, meta, sample_rows = open_message(message, runner.device)
    with serial_if(ids.numel() <= runner.serial_tokens):
        runner.forward(ids, positions, meta, sample_rows)
    if runner.lora is not None:
        runner.lora.end_step()


def follower_main(rank: int, spec: RankSpec) -> None:
    """Rank ``rank``: build this rank's runner, then run each step rank 0 broadcasts."""
    _follow_the_leader()
    torch.set_num_threads(spec.threads)
    model = spec.model_for(rank)
    init_group(TPConfig(spec.size, rank), spec.group,
               "cuda" if model.device.startswith("cuda") else "cpu")
    try:
        runner = ModelRunner(model, spec.cache, spec.max_num_seqs, lora=spec.lora,
                             tp=TPConfig(spec.size, rank))
        steps = follower_loop(lambda message: follow_step(runner, message))
        _log.info("tensor_parallel_follower_done", rank=rank, steps=steps)
    finally:
        close_group()
