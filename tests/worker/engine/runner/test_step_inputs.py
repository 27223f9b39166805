"""A step's flat inputs from the rows' arrays equal those read from the requests, and the
one-copy transfer keeps every array's values, dtype and alignment."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from protocol.sampling import SamplingParams
from tests.worker.engine.fake_runner import make_scheduler
from worker.engine.inflight import InflightStep
from worker.engine.request import PLACEHOLDER, Request
from worker.engine.runner.step_inputs import StepInputs, build_inputs, to_device_packed
from worker.engine.sched.scheduler import Scheduler, SchedulerOutput


def test_one_copy_keeps_values_dtypes_and_16_byte_alignment() -> None:
    arrays = [np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int32) - 7,
              np.zeros(0, dtype=np.int64), np.array([2**40, -1], dtype=np.int64),
              np.arange(8, dtype=np.int32)]
    views = to_device_packed(arrays, torch.device("cpu"), pack=True)
    for array, view in zip(arrays, views, strict=True):
        assert view.dtype == torch.from_numpy(array).dtype
        assert view.tolist() == array.tolist()
        assert view.data_ptr() % 16 == 0
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one copy


def _by_hand(out: SchedulerOutput) -> SchedulerOutput:
    """The same step without its arrays (as one built by hand is)."""
    return SchedulerOutput(list(out.scheduled), out.num_batched_tokens, out.preempted)


def _same(a: StepInputs, b: StepInputs) -> None:
    for name in ("ids", "positions", "slots", "query_start", "seq_lens", "rows",
                 "sample_rows", "num_new", "patch_dst", "patch_src"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.num_decodes == b.num_decodes


def _inflight(out: SchedulerOutput) -> InflightStep:
    tokens = torch.arange(len(out.sampling)) + 900
    return InflightStep(out, SimpleNamespace(tokens=tokens),  # type: ignore[arg-type]
                        {r.request_id: i for i, r in enumerate(out.sampling)})


def test_inputs_from_the_rows_equal_inputs_from_the_requests() -> None:
    """Prefill chunks, decodes, a prompt's last token alone, placeholders from the step in
    flight (and their rows in its sampled tokens), overlapped steps throughout."""
    rng = random.Random(3)
    sched: Scheduler = make_scheduler(num_blocks=80, block_size=4, max_num_seqs=6,
                                      budget=24, chunk=7)
    for i in range(9):
        sched.add(Request(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))],
                          SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0)))
    prev: InflightStep | None = None
    seen_placeholder = seen_chunk = False
    while sched.has_unfinished():
        out = sched.schedule()
        if out.is_empty:
            break
        host = sched.block_manager.host
        fast = build_inputs(out, host, 4, prev)
        _same(fast, build_inputs(_by_hand(out), host, 4, prev))
        if prev is not None:  # ...and with the step in flight known only by request id
            _same(fast, build_inputs(out, host, 4, InflightStep(
                _by_hand(prev.sched), prev.sample, prev.row_of)))
        for item, lo, hi in zip(out.scheduled, fast.query_start[:-1], fast.query_start[1:],
                                strict=True):
            r = item.request
            want = r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + hi - lo]
            assert fast.ids[lo:hi].tolist() == want
        seen_placeholder |= PLACEHOLDER in fast.ids.tolist()
        seen_chunk |= len(fast.ids) > len(fast.rows)
        sched.advance(out)
        if prev is not None:
            sched.resolve_sampled(prev.sched, prev.sample.tokens.numpy())
        prev = _inflight(out)
    assert seen_placeholder and seen_chunk
