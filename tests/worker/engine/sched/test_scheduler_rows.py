"""The array paths of the scheduler decide exactly what the per-request algorithm decides.

``Scheduler.schedule`` takes runs of decode rows whole (``BatchRows.decodes``) and gives
only the others to ``_allocate``; ``advance`` and ``resolve_sampled`` move counters and
check EOS / stop ids / ``min_tokens`` / ``max_tokens`` / the model's context over arrays.
``Reference`` below is the scheduler as it was before, one request at a time. Both run
the same random workloads — shared prefixes (prefix cache), chunked prefill, a small pool
(preemption), priorities (preemption for admission), aborts, stop ids and EOS with
``min_tokens``, a short model context, steps overlapped or not, and step outputs filtered
by hand (no arrays) — and must agree at
every step: the rows, their order and token counts, the preempted, every block table, the
prefix-cache counters, the tokens handed back and how each request ends. The rows'
arrays are checked against the requests before every step (``check_invariants``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.sampling import SamplingParams
from tests.worker.engine.fake_runner import make_scheduler, resolve
from worker.engine.request import FinishReason, Request, RequestStatus
from worker.engine.sched.scheduler import ScheduledRequest, Scheduler, SchedulerOutput


class Reference(Scheduler):
    """The per-request scheduler: every running request through ``_allocate``, then the
    stable sort; advance and resolve one request at a time."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.block_manager.begin_step()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        self.running.sort(key=Request.sort_key)
        pending = list(self.running)
        while pending and budget > 0:
            request = pending.pop(0)
            if request.will_finish_by_length(self.max_model_len):
                continue
            while (item := self._allocate(request, budget)) is None:
                victim = pending.pop() if pending else request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(item)
                budget -= item.num_new_tokens
        if not out.preempted:
            budget = self._admit(scheduled, budget)
        scheduled.sort(key=lambda s: (s.num_new_tokens != 1, s.num_new_tokens == 1
                                      and s.request.num_tokens))
        out.scheduled = scheduled
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def advance(self, output: SchedulerOutput) -> None:
        for item in output.scheduled:
            if not item.request.is_finished:
                item.request.num_computed_tokens += item.num_new_tokens
                if item.sample:
                    item.request.append_placeholder()

    def resolve(self, output: SchedulerOutput,
                sampled: Any) -> list[tuple[Request, int]]:
        got = []
        for item, token in zip(output.scheduled, sampled, strict=True):
            request = item.request
            if request.is_finished or not item.sample or token is None:
                continue
            request.resolve_placeholder(token)
            got.append((request, token))
            reason = request.check_token_stop(token, self.max_model_len)
            if reason is not None:
                self.finish(request, reason)
        return got


@dataclass(frozen=True)
class Spec:
    prefix: int
    tail: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_id: int | None
    priority: int
    steps_after: int
    abort: bool


def _token(request: Request) -> int:
    """The fake model: a function of the request and its length (placeholders count), so
    both schedulers see the same tokens as long as they schedule the same."""
    return (sum(map(ord, request.request_id)) * 7 + request.num_tokens * 13) % 61


def _snapshot(sched: Scheduler, out: SchedulerOutput) -> tuple[Any, ...]:
    bm = sched.block_manager
    return ([(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled],
            [r.request_id for r in out.preempted], out.num_batched_tokens,
            {rid: list(t) for rid, t in bm.tables.items()}, bm.stats.queries, bm.stats.hits,
            bm.num_cached_blocks, [r.request_id for r in sched.running])


def _resolve(sched: Scheduler, out: SchedulerOutput,
             sampled: list[int | None]) -> list[tuple[Request, int]]:
    """The reference's own per-request resolve, or the scheduler's (``resolve_sampled``)."""
    if isinstance(sched, Reference):
        return sched.resolve(out, sampled)
    return resolve(sched, out, sampled)


def _drive(sched: Scheduler, specs: list[Spec], overlap: bool, strip: int,
           checked: bool) -> list[Any]:
    trace: list[Any] = []
    inflight: tuple[SchedulerOutput, list[int | None]] | None = None
    requests: list[Request] = []

    def step(n: int) -> None:
        nonlocal inflight
        if checked:
            sched.check_invariants()
        out = sched.schedule()
        trace.append(_snapshot(sched, out))
        if strip and n % strip == 0:  # filtered by hand: the arrays are gone
            out = SchedulerOutput(list(out.scheduled), out.num_batched_tokens, out.preempted)
        sampled = [_token(s.request) if s.sample else None for s in out.scheduled]
        sched.advance(out)
        if inflight is not None:
            trace.append([(r.request_id, t) for r, t in _resolve(sched, *inflight)])
        inflight = (out, sampled)
        if not overlap:
            trace.append([(r.request_id, t) for r, t in _resolve(sched, *inflight)])
            inflight = None

    n = 0
    for i, spec in enumerate(specs):
        prompt = list(range(1, spec.prefix + 1)) + [100 + 31 * i + k for k in range(spec.tail)]
        params = SamplingParams(
            max_tokens=spec.max_tokens, min_tokens=min(spec.min_tokens, spec.max_tokens),
            temperature=0, ignore_eos=spec.ignore_eos,
            stop_token_ids=[] if spec.stop_id is None else [spec.stop_id])
        request = Request(f"r{i}", prompt, params, eos_token_ids=frozenset({0, 5}),
                          priority=spec.priority, arrival_time=float(i))
        sched.add(request)
        requests.append(request)
        for _ in range(spec.steps_after):
            step(n := n + 1)
        if spec.abort and sched.running:
            sched.abort(sched.running[-1].request_id)
    while sched.has_unfinished() and n < 3000:
        step(n := n + 1)
    if inflight is not None:
        trace.append([(r.request_id, t) for r, t in _resolve(sched, *inflight)])
    assert not sched.has_unfinished()
    trace.append([(r.request_id, r.output_token_ids, r.finish_reason) for r in requests])
    return trace


def _scheduler(cls: type[Scheduler], num_blocks: int, block_size: int, caching: bool,
               max_model_len: int) -> Scheduler:
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=5,
                           budget=20, chunk=7, max_model_len=max_model_len)
    if cls is not Scheduler:
        sched.__class__ = cls
    sched.block_manager.enable_caching = caching
    return sched


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_requests=st.integers(1, 12),
    overlap=st.booleans(),
    strip=st.sampled_from([0, 0, 2, 5]),
    caching=st.booleans(),
    max_model_len=st.sampled_from([24, 40, 4096]),
)
def test_the_array_paths_decide_what_the_per_request_scheduler_decides(
    data: st.DataObject, num_blocks: int, block_size: int, num_requests: int,
    overlap: bool, strip: int, caching: bool, max_model_len: int,
) -> None:
    specs = []
    for _ in range(num_requests):
        spec = Spec(
            prefix=data.draw(st.integers(0, 20), label="prefix"),
            tail=data.draw(st.integers(1, 6), label="tail"),
            max_tokens=data.draw(st.integers(1, 12), label="max_tokens"),
            min_tokens=data.draw(st.integers(0, 4), label="min_tokens"),
            ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
            stop_id=data.draw(st.none() | st.integers(0, 60), label="stop id"),
            priority=data.draw(st.integers(-1, 1), label="priority"),
            steps_after=data.draw(st.integers(0, 3), label="steps between arrivals"),
            abort=data.draw(st.booleans(), label="abort one"),
        )
        tokens = min(spec.prefix + spec.tail + spec.max_tokens, max_model_len)
        if spec.prefix + spec.tail < max_model_len \
                and -(-tokens // block_size) <= num_blocks:  # what the engine admits
            specs.append(spec)
    want = _drive(_scheduler(Reference, num_blocks, block_size, caching, max_model_len),
                  specs, overlap, strip, checked=False)
    got = _drive(_scheduler(Scheduler, num_blocks, block_size, caching, max_model_len),
                 specs, overlap, strip, checked=True)
    assert got == want


def test_decode_rows_cross_blocks_and_register_them_without_the_general_path() -> None:
    """The workload the arrays are for: many decodes, some entering a fresh block or
    filling one for the prefix cache each step, and nothing else goes through
    ``_allocate``; the blocks and the cache equal the per-request scheduler's."""
    runs = []
    for cls in (Reference, Scheduler):
        sched = _scheduler(cls, num_blocks=200, block_size=4, caching=True,
                           max_model_len=4096)
        sched.config = type(sched.config)(max_num_seqs=16, max_num_batched_tokens=512,
                                          long_prefill_token_threshold=512)
        calls = 0
        allocate = sched._allocate

        def counted(request: Request, budget: int, admitting: bool = False,
                    allocate: Any = allocate) -> Any:
            nonlocal calls
            calls += 1
            return allocate(request, budget, admitting)

        sched._allocate = counted  # type: ignore[method-assign]
        for i in range(16):
            sched.add(Request(f"r{i}", list(range(1, 3 + i)), SamplingParams(
                max_tokens=30, temperature=0, ignore_eos=True)))
        trace = _drive(sched, [], overlap=True, strip=0, checked=cls is Scheduler)
        runs.append((trace, calls))
    (want, reference_calls), (got, calls) = runs
    assert got == want
    assert reference_calls >= 16 * 29 and calls == 16  # admissions only
    assert all(reason is FinishReason.LENGTH for _, _, reason in got[-1])


def test_finish_checks_over_arrays_match_check_token_stop() -> None:
    """EOS ignored before min_tokens and with ignore_eos, stop ids, max_tokens and the
    model's context, resolved for a whole batch at once."""
    sched = make_scheduler(max_model_len=9, max_num_seqs=8)
    cases = {  # prompt of 3; (params, the token of every step, how it ends, outputs)
        "eos": (SamplingParams(max_tokens=5), 0, FinishReason.STOP, 1),
        "min": (SamplingParams(max_tokens=5, min_tokens=2), 0, FinishReason.STOP, 2),
        "ignore": (SamplingParams(max_tokens=3, ignore_eos=True), 0, FinishReason.LENGTH, 3),
        "stop": (SamplingParams(max_tokens=5, stop_token_ids=[7]), 7, FinishReason.STOP, 1),
        "other": (SamplingParams(max_tokens=4), 8, FinishReason.LENGTH, 4),
        "context": (SamplingParams(max_tokens=50, ignore_eos=True), 1, FinishReason.LENGTH, 6),
    }
    requests = [Request(rid, [1, 2, 3], params, eos_token_ids=frozenset({0}))
                for rid, (params, _, _, _) in cases.items()]
    for request in requests:
        sched.add(request)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.advance(out)
        got = sched.resolve_sampled(out, [cases[r.request_id][1] for r in out.sampling])
        assert got.requests == out.sampling  # nobody finished before its token
    for request in requests:
        _, _, reason, count = cases[request.request_id]
        assert (request.finish_reason, request.num_output_tokens) == (reason, count), \
            request.request_id


def test_a_preempted_request_still_gets_its_token_in_flight() -> None:
    """Overlapped: a request preempted while its token is being read back is resolved one
    request at a time (its row is gone) and can end on that token from the waiting list."""
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_seqs=2, budget=20, chunk=20)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0),
                eos_token_ids=frozenset({0}), priority=0, arrival_time=0.0)
    b = Request("b", [5], SamplingParams(max_tokens=3, temperature=0),
                eos_token_ids=frozenset({0}), priority=1, arrival_time=1.0)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # both admitted: a takes 2 blocks, b the 3rd
    sched.advance(first)
    second = sched.schedule()  # a needs a 3rd block: b (lower priority) is preempted
    assert [r.request_id for r in second.preempted] == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_pending == 1
    sched.advance(second)
    tokens = {"a": 9, "b": 0}
    got = sched.resolve_sampled(first, [tokens[r.request_id] for r in first.sampling])
    assert sorted(r.request_id for r in got.requests) == ["a", "b"]
    assert b.finish_reason is FinishReason.STOP and b.output_token_ids == [0]
    assert a.output_token_ids[0] == 9 and not a.is_finished
    sched.check_invariants()
