"""Overlapped steps under the scheduler, with a simulated KV cache instead of a model.

The driver does what the engine does with ``async_scheduling``: schedule and launch step
N+1 (``advance``: placeholders for its sampled tokens) before resolving step N. The
simulated device writes each scheduled token into its slot, taking a placeholder's value
from the step in flight (as ``patch_placeholders`` does on the GPU), then reads every scheduled
request's context back: it must equal the request's tokens. For random workloads with
shared prefixes, a small pool (preemption), chunked prefill, stop tokens that end a
request while its next step is launched, aborts and priorities, every request that was
not aborted must end with exactly the tokens and finish reason of the same workload run
one step at a time, and no block may leak.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.sampling import SamplingParams
from tests.worker.engine.fake_runner import check_step, fake_token, make_scheduler, resolve
from worker.engine.request import PLACEHOLDER, Request
from worker.engine.sched.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class Spec:
    prefix: int
    tail: int
    max_tokens: int
    stop_after: int | None  # the fake token that ends it, as an output index
    priority: int
    steps_after: int  # steps run before the next arrival
    abort: bool


class Device:
    """Simulated KV slots and the step in flight (its sampled tokens, by request)."""

    def __init__(self, sched: Scheduler, overlap: bool) -> None:
        self.sched, self.overlap = sched, overlap
        self.slots: dict[int, int] = {}
        self.inflight: tuple[SchedulerOutput, list[int | None]] | None = None
        self.pending: dict[str, int] = {}  # request id -> its token in the step in flight
        self.rows = 0  # tokens computed, over all steps

    def _value(self, req: Request, pos: int) -> int:
        token = req.all_token_ids[pos]
        return self.pending[req.request_id] if token == PLACEHOLDER else token

    def step(self) -> None:
        sched, bs = self.sched, self.sched.block_manager.block_size
        out = sched.schedule()
        check_step(sched, out)
        self.rows += out.num_batched_tokens
        for item in out.scheduled:  # every layer stores all tokens before attention reads
            req, table = item.request, sched.block_manager.block_table(item.request.request_id)
            for pos in range(req.num_computed_tokens, req.num_computed_tokens
                             + item.num_new_tokens):
                self.slots[table[pos // bs] * bs + pos % bs] = self._value(req, pos)
        for item in out.scheduled:
            req, table = item.request, sched.block_manager.block_table(item.request.request_id)
            hi = req.num_computed_tokens + item.num_new_tokens
            seen = [self.slots.get(table[p // bs] * bs + p % bs) for p in range(hi)]
            assert seen == [self._value(req, p) for p in range(hi)], req.request_id
        sampled = [fake_token(s.request) if s.sample else None for s in out.scheduled]
        sched.advance(out)
        self.flush()
        self.inflight = (out, sampled)
        self.pending = {s.request.request_id: t for s, t in zip(out.scheduled, sampled,
                                                                strict=True) if t is not None}
        if not self.overlap:
            self.flush()

    def flush(self) -> None:
        if self.inflight is not None:
            resolve(self.sched, *self.inflight)
            self.inflight, self.pending = None, {}


def _run(specs: list[Spec], overlap: bool, num_blocks: int, block_size: int
         ) -> tuple[dict[str, tuple[list[int], str]], set[str]]:
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                           budget=24, chunk=8)
    device = Device(sched, overlap)
    requests: list[Request] = []
    aborted: set[str] = set()
    for i, spec in enumerate(specs):
        prompt = list(range(1, spec.prefix + 1)) + [500 + 31 * i + k for k in range(spec.tail)]
        stop = [] if spec.stop_after is None else [1000 + len(prompt) + spec.stop_after]
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0,
                                stop_token_ids=stop)
        req = Request(f"r{i}", prompt, params, eos_token_ids=frozenset({0}),
                      priority=spec.priority, arrival_time=float(i))
        sched.add(req)
        requests.append(req)
        for _ in range(spec.steps_after):
            device.step()
        if spec.abort and sched.running:
            aborted.add(sched.running[0].request_id)
            sched.abort(sched.running[0].request_id)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        device.step()
    device.flush()
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks  # nothing leaked: every block free or evictable
    bm.check_invariants()
    assert all(r.num_pending == 0 and PLACEHOLDER not in r.all_token_ids for r in requests)
    return {r.request_id: (r.output_token_ids, str(r.finish_reason)) for r in requests}, aborted


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(8, 32),
    block_size=st.sampled_from([2, 4, 8]),
    num_requests=st.integers(2, 14),
)
def test_overlapped_steps_give_the_outputs_of_one_step_at_a_time(
    data: st.DataObject, num_blocks: int, block_size: int, num_requests: int
) -> None:
    specs = []
    for _ in range(num_requests):
        spec = Spec(
            prefix=data.draw(st.integers(0, 30), label="prefix"),
            tail=data.draw(st.integers(1, 6), label="tail"),
            max_tokens=data.draw(st.integers(1, 8), label="max_tokens"),
            stop_after=data.draw(st.none() | st.integers(0, 6), label="stop_after"),
            priority=data.draw(st.integers(-1, 1), label="priority"),
            steps_after=data.draw(st.integers(0, 3), label="steps between arrivals"),
            abort=data.draw(st.booleans(), label="abort one"),
        )
        if (spec.prefix + spec.tail + spec.max_tokens + block_size - 1) // block_size \
                <= num_blocks:  # the engine refuses larger requests up front
            specs.append(spec)
    expected, aborted_sync = _run(specs, False, num_blocks, block_size)
    got, aborted = _run(specs, True, num_blocks, block_size)
    for rid, result in expected.items():
        if rid not in aborted | aborted_sync:  # a cancel lands a step later when overlapped
            assert got[rid] == result, rid


def test_requests_ending_by_length_get_no_wasted_step() -> None:
    """A request whose pending tokens reach max_tokens (or the model's context) is not
    scheduled again: only a stop token or a cancel can cost an extra row."""
    rows, outputs = [], []
    for overlap in (False, True):
        sched = make_scheduler(max_model_len=12)
        device = Device(sched, overlap)
        reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=n, temperature=0))
                for i, n in enumerate((1, 3, 5, 20))]  # r3 ends at the model's context
        for req in reqs:
            sched.add(req)
        while sched.has_unfinished():
            device.step()
        device.flush()
        rows.append(device.rows)
        outputs.append([(r.output_token_ids, str(r.finish_reason)) for r in reqs])
    assert outputs[0] == outputs[1] and outputs[1][3][1] == "length"
    assert rows[0] == rows[1]
