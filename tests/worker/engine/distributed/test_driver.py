"""Rank 0 drives rank 1 through greedy decoding on a tiny sharded Llama: the tokens and
logprobs equal one unsharded process; a rank 1 killed with SIGKILL fails rank 0's next
step within 30 s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from worker.engine.distributed.driver import (
    follower_loop,
    lead_step,
    spawn_followers,
    stop_followers,
)
from worker.engine.distributed.group import GroupSpec, close_group, init_group
from worker.engine.distributed.shard_model import shard_model
from worker.engine.distributed.tp_config import TPConfig

from .test_shard_model import _model

SIZE = 2


def _forward(model: Any) -> Any:
    return lambda ids: model(torch.tensor(ids), use_cache=False).logits


def _follower(rank: int, init: str) -> None:
    torch.set_num_threads(1)
    tp = TPConfig(size=SIZE, rank=rank)
    init_group(tp, GroupSpec(init, 30.0), "cpu")
    try:
        follower_loop(_forward(shard_model(_model("llama_gqa"), tp)))
    finally:
        close_group()


def _greedy(forward: Any, steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = [5, 17, 3], []
    for _ in range(steps):
        logits = forward([ids])[0, -1]  # [vocab]
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids, logprobs


def _leader(init: str, out: str, kill: bool) -> None:
    torch.set_num_threads(1)
    followers = spawn_followers(SIZE, _follower, (init,))
    tp = TPConfig(size=SIZE, rank=0)
    init_group(tp, GroupSpec(init, 30.0), "cpu")
    forward = _forward(shard_model(_model("llama_gqa"), tp))
    try:
        if kill:
            lead_step(forward, [[1, 2]])
            os.kill(followers[0].pid or 0, signal.SIGKILL)
            started = time.monotonic()
            try:
                for _ in range(3):
                    lead_step(forward, [[1, 2]])
                Path(out).write_text("returned")
            except RuntimeError:
                Path(out).write_text(f"raised {time.monotonic() - started:.1f}")
            return
        ids, logprobs = _greedy(lambda m: lead_step(forward, m), 6)
        stop_followers()
        want_ids, want_lp = _greedy(_forward(_model("llama_gqa")), 6)
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_lp),
                                   rtol=0, atol=1e-5)
        Path(out).write_text("equal")
    finally:
        for proc in followers:
            proc.join(timeout=40)
        close_group()


def _run_leader(tmp_path: Path, kill: bool) -> str:
    out = tmp_path / "out"
    leader = mp.get_context("spawn").Process(
        target=_leader, args=(f"file://{tmp_path}/rdv", str(out), kill))
    leader.start()
    leader.join(timeout=120)
    assert leader.exitcode is not None, "rank 0 hung"
    return out.read_text()


def test_rank0_drives_rank1_to_the_tokens_of_one_process(tmp_path: Path) -> None:
    assert _run_leader(tmp_path, kill=False) == "equal"


def test_kill_9_of_rank1_fails_rank0_within_30s(tmp_path: Path) -> None:
    outcome = _run_leader(tmp_path, kill=True)
    assert outcome.startswith("raised"), outcome
    assert float(outcome.split()[1]) <= 30.0
