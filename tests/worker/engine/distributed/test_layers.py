"""Tensor-parallel layers on two gloo ranks equal the unsharded layers, and a rank that
dies or hangs turns into an error on the survivor within the group's timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

from worker.engine.distributed.group import (
    GroupSpec,
    all_reduce_sum,
    broadcast_object,
    close_group,
    init_group,
)
from worker.engine.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from worker.engine.distributed.tp_config import TPConfig

SIZE = 2


def _full_modules() -> tuple[nn.Linear, nn.Linear, nn.Embedding, nn.Linear]:
    torch.manual_seed(0)
    up = nn.Linear(8, 12, bias=True)
    down = nn.Linear(12, 8, bias=True)
    embed = nn.Embedding(11, 8)  # an odd vocabulary: the last rank's share is short
    head = nn.Linear(8, 11, bias=False)
    return up, down, embed, head


def _layers_rank(rank: int, init_method: str) -> None:
    torch.set_num_threads(1)
    init_group(TPConfig(size=SIZE, rank=rank), GroupSpec(init_method, 20.0), "cpu")
    try:
        up, down, embed, head = _full_modules()
        ids = torch.tensor([[0, 5, 6, 10], [3, 7, 1, 9]])
        with torch.no_grad():
            want = head(down(torch.relu(up(embed(ids)))))
            mlp_in = VocabParallelEmbedding(embed, rank, SIZE)(ids)
            mid = torch.relu(ColumnParallelLinear(up, rank, SIZE)(mlp_in))
            got = ParallelLMHead(head, rank, SIZE)(RowParallelLinear(down, rank, SIZE)(mid))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        step = broadcast_object({"step": 7, "ids": [1, 2]} if rank == 0 else None)
        assert step == {"step": 7, "ids": [1, 2]}
    finally:
        close_group()


def test_parallel_layers_equal_the_full_layers(tmp_path: Path) -> None:
    mp.spawn(_layers_rank, args=(f"file://{tmp_path}/rendezvous",), nprocs=SIZE, join=True)


def _dying_rank(rank: int, init_method: str, result: str) -> None:
    torch.set_num_threads(1)
    init_group(TPConfig(size=SIZE, rank=rank), GroupSpec(init_method, 5.0), "cpu")
    # Rank 1 dies only once rank 0 is past the group's set-up (rank 0 may still be
    # connecting its last subgroup when rank 1's init returns): the death must hit the
    # collective, not init.
    ready = Path(result + ".ready")
    if rank == 1:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(9)  # as a kill -9 would: no goodbye to the group
    ready.write_text("")
    started = time.monotonic()
    try:
        all_reduce_sum(torch.ones(4))  # the forward's reduction, on its timed group
        outcome = "returned"
    except RuntimeError as err:  # gloo: the peer closed, or the timeout ran out
        outcome = f"raised {type(err).__name__}"
    Path(result).write_text(f"{outcome} {time.monotonic() - started:.1f}")


def test_a_dead_rank_fails_the_collective_in_bounded_time(tmp_path: Path) -> None:
    result = tmp_path / "result"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dying_rank,
                         args=(r, f"file://{tmp_path}/rendezvous", str(result)))
             for r in range(SIZE)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode is not None, "a rank hung past the collective timeout"
    outcome, seconds = result.read_text().rsplit(" ", 1)
    assert outcome.startswith("raised"), outcome
    assert float(seconds) <= 30.0


def _hanging_rank(rank: int, init_method: str, result: str) -> None:
    torch.set_num_threads(1)
    init_group(TPConfig(size=SIZE, rank=rank), GroupSpec(init_method, 3.0), "cpu")
    if rank == 1:
        time.sleep(20)  # alive but never joins the collective: a hung rank
        os._exit(0)
    started = time.monotonic()
    try:
        all_reduce_sum(torch.ones(4))  # the forward's reduction, on its timed group
        outcome = "returned"
    except RuntimeError:
        outcome = "raised"
    Path(result).write_text(f"{outcome} {time.monotonic() - started:.1f}")
    os._exit(0)


def test_a_hung_rank_fails_the_collective_at_the_timeout(tmp_path: Path) -> None:
    result = tmp_path / "result"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hanging_rank,
                         args=(r, f"file://{tmp_path}/rendezvous", str(result)))
             for r in range(SIZE)]
    for p in procs:
        p.start()
    procs[0].join(timeout=60)
    outcome, seconds = result.read_text().rsplit(" ", 1)
    for p in procs:
        p.join(timeout=60)
    assert outcome == "raised", outcome
    assert 2.0 <= float(seconds) <= 15.0
