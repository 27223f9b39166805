"""The prefix cache under the scheduler, with a simulated KV cache instead of a model.

Every step "stores" each scheduled token into its slot (block table[pos // bs], offset
pos % bs) and then "reads" every scheduled request's whole context back from its block
table: it must equal the request's own tokens. That is exactly what attention relies on,
so a shared block with the wrong contents, a block evicted while in use, or one cached
before it was written fails here, for random workloads with shared prefixes, a small pool
(preemption), chunked prefill, aborts and priorities.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.engine.fake_runner import (
    check_step,
    fake_token,
    make_request,
    make_scheduler,
    update,
)
from worker.engine.request import Request
from worker.engine.sched.scheduler import Scheduler


class SimulatedKV:
    """slot -> the token whose K/V it holds (what a real forward would write there)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slots: dict[int, int] = {}

    def step(self) -> list[tuple[Request, int]]:
        sched, bs = self.sched, self.sched.block_manager.block_size
        out = sched.schedule()
        check_step(sched, out)
        for item in out.scheduled:  # every layer stores all tokens before attention reads
            req, table = item.request, sched.block_manager.block_table(item.request.request_id)
            lo = req.num_computed_tokens
            for pos in range(lo, lo + item.num_new_tokens):
                self.slots[table[pos // bs] * bs + pos % bs] = req.all_token_ids[pos]
        for item in out.scheduled:
            req, table = item.request, sched.block_manager.block_table(item.request.request_id)
            hi = req.num_computed_tokens + item.num_new_tokens
            seen = [self.slots.get(table[p // bs] * bs + p % bs) for p in range(hi)]
            assert seen == req.all_token_ids[:hi], f"{req.request_id}: wrong KV in its blocks"
        sampled = [fake_token(s.request) if s.sample else None for s in out.scheduled]
        return update(sched, out, sampled)


def _prompt(shared: list[int], prefix_len: int, tail: int, seed: int) -> list[int]:
    return shared[:prefix_len] + [500 + seed * 31 + i for i in range(tail)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(8, 32),
    block_size=st.sampled_from([2, 4, 8]),
    num_requests=st.integers(2, 16),
)
def test_cached_blocks_always_hold_the_right_tokens(
    data: st.DataObject, num_blocks: int, block_size: int, num_requests: int
) -> None:
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                           budget=24, chunk=8)
    sim = SimulatedKV(sched)
    shared = list(range(1, 40))
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    for i in range(num_requests):
        prefix = data.draw(st.integers(0, 30), label="prefix")
        tail = data.draw(st.integers(1, 6), label="tail")
        max_tokens = data.draw(st.integers(1, 6), label="max_tokens")
        if (prefix + tail + max_tokens + block_size - 1) // block_size > num_blocks:
            continue  # the engine refuses such a request up front
        req = make_request(f"r{i}", 1, max_tokens, priority=data.draw(st.integers(-1, 1)),
                           arrival=float(i))
        req.prompt_token_ids[:] = _prompt(shared, prefix, tail, i)
        req.all_token_ids[:] = list(req.prompt_token_ids)
        sched.add(req)
        expected[req.request_id] = max_tokens
        for _ in range(data.draw(st.integers(0, 3), label="steps between arrivals")):
            sim.step()
        if data.draw(st.booleans(), label="abort one") and sched.running:
            victim = sched.running[0].request_id
            sched.abort(victim)
            aborted.add(victim)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        sim.step()
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks  # nothing leaked: every block free or evictable
    bm.check_invariants()


def test_same_step_sharing_is_kept_safe_from_priority_preemption() -> None:
    """A low-priority request is mid-prefill: this step it computes (and registers) the next
    blocks of a long prompt. A higher-priority request with the same prompt is admitted in
    the same step and shares them; then an urgent request needs room. The provider must not
    be preempted now (the sharer would read blocks nobody wrote this step)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, budget=64, chunk=8)
    sim = SimulatedKV(sched)
    prompt = list(range(1, 42))
    provider = make_request("provider", 1, 3, priority=5)
    provider.prompt_token_ids[:] = prompt
    provider.all_token_ids[:] = list(prompt)
    sched.add(provider)
    sim.step()  # provider computes its first chunk
    sharer = make_request("sharer", 1, 3, priority=-10, arrival=1.0)
    sharer.prompt_token_ids[:] = prompt
    sharer.all_token_ids[:] = list(prompt)
    sched.add(sharer)
    sched.add(make_request("urgent", 4, 2, priority=-5, arrival=2.0))
    for _ in range(100):
        if not sched.has_unfinished():
            break
        sim.step()
    assert not sched.has_unfinished()
    assert sched.block_manager.stats.hits > 0


def test_an_evicted_block_is_never_served_for_its_old_prefix() -> None:
    """A fills the pool and finishes (its blocks stay cached); B needs the whole pool, so A's
    blocks are evicted and rewritten; C repeats A's prompt and must compute it again."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=1, budget=64, chunk=64)
    sim = SimulatedKV(sched)
    for rid, prompt in (("a", list(range(1, 20))), ("b", list(range(100, 120))),
                        ("c", list(range(1, 20)))):
        req = make_request(rid, 1, 2)
        req.prompt_token_ids[:] = prompt
        req.all_token_ids[:] = list(prompt)
        sched.add(req)
        for _ in range(50):
            if not sched.has_unfinished():
                break
            sim.step()
    assert sched.block_manager.stats.hits == 0
