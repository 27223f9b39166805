"""Rank 0 killed with SIGKILL leaves no follower behind holding its shard of the model:
rank 1 ends within seconds (``PR_SET_PDEATHSIG``, or its broadcast's closed connection)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import torch.multiprocessing as mp

from tests.family_checkpoints import build_family


def _rank0(path: str, out: str) -> None:
    from worker.engine.llm import LLM

    llm = LLM(path, tensor_parallel_size=2, device="cpu", kv_cache_blocks=16)
    assert llm.engine.ranks is not None
    Path(out).write_text(str(llm.engine.ranks.procs[0].pid))
    time.sleep(600)  # killed long before


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill_9_of_rank0_ends_its_follower(tmp_path: Path) -> None:
    path = build_family("llama", tmp_path)
    out = tmp_path / "follower.pid"
    rank0 = mp.get_context("spawn").Process(target=_rank0, args=(path, str(out)))
    rank0.start()
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            assert time.monotonic() < deadline and rank0.is_alive(), "rank 0 did not start"
            time.sleep(0.1)
        follower = int(out.read_text())
        assert not _gone(follower)
        os.kill(rank0.pid or 0, signal.SIGKILL)
        rank0.join(10)
        deadline = time.monotonic() + 10
        while not _gone(follower):
            assert time.monotonic() < deadline, "rank 1 outlived rank 0"
            time.sleep(0.05)
    finally:
        if rank0.is_alive():
            rank0.kill()
