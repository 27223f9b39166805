from tests.worker.engine.fake_runner import (
    make_request,
    make_scheduler,
    run_step,
    run_to_completion,
    update,
)
from worker.engine.request import FinishReason, RequestStatus


def expected_tokens(prompt_len: int, max_tokens: int) -> list[int]:
    return [1000 + prompt_len + i for i in range(max_tokens)]


def test_admission_respects_max_num_seqs_and_budget():
    sched = make_scheduler(max_num_seqs=2, budget=10, chunk=10)
    for i in range(4):
        sched.add(make_request(f"r{i}", prompt_len=4, max_tokens=3))
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert out.num_batched_tokens == 8
    assert len(sched.waiting) == 2


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sched = make_scheduler(budget=8, chunk=8)
    sched.add(make_request("short", prompt_len=3, max_tokens=20))
    run_step(sched)  # short prefilled
    sched.add(make_request("long", prompt_len=30, max_tokens=2))
    chunks = []
    for _ in range(5):
        out, _ = run_step(sched)
        ids = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert ids.get("short") == 1  # the decode is never stalled
        chunks.append(ids.get("long", 0))
    assert chunks[:4] == [7, 7, 7, 7] and sum(chunks) >= 30 - 2
    outs = run_to_completion(sched)
    assert outs["long"] == expected_tokens(30, 2)
    assert outs["short"] == expected_tokens(3, 20)


def test_finish_frees_blocks_in_same_step():
    sched = make_scheduler(num_blocks=16, block_size=4)
    sched.add(make_request("a", prompt_len=4, max_tokens=1))
    _, new = run_step(sched)
    assert new[0][0].finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 16


def test_priority_orders_waiting_queue():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("late-low", 4, 2, priority=5, arrival=0.0))
    sched.add(make_request("urgent", 4, 2, priority=-1, arrival=1.0))
    sched.add(make_request("normal", 4, 2, priority=0, arrival=2.0))
    order = []
    while sched.has_unfinished():
        out, _ = run_step(sched)
        for s in out.scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    assert order == ["urgent", "normal", "late-low"]


def test_preemption_picks_lowest_priority_latest_and_resumes_same_output():
    # 6 blocks of 4 tokens: three requests growing to 12 tokens each cannot all fit.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, chunk=64)
    sched.add(make_request("a", 4, 8, priority=0, arrival=0.0))
    sched.add(make_request("b", 4, 8, priority=0, arrival=1.0))
    sched.add(make_request("c", 4, 8, priority=1, arrival=0.5))
    preempted = []
    reqs = dict(sched.requests)
    while sched.has_unfinished():
        out, _ = run_step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "c"
    assert reqs["c"].num_preemptions >= 1
    for rid, req in reqs.items():
        assert req.output_token_ids == expected_tokens(4, 8), rid
    assert sched.block_manager.num_free_blocks == 6


def test_request_larger_than_pool_preempts_itself_without_looping():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=64, chunk=64)
    sched.add(make_request("a", 4, 20))
    for _ in range(10):
        run_step(sched)
    assert sched.requests["a"].status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    sched.abort("a")
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_free_blocks == 2


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("run", 4, 50))
    sched.add(make_request("wait", 4, 50))
    run_step(sched)
    assert sched.abort("wait").finish_reason is FinishReason.ABORT
    assert sched.abort("run").finish_reason is FinishReason.ABORT
    assert sched.abort("unknown") is None
    assert not sched.has_unfinished()
    out, _ = run_step(sched)
    assert out.is_empty
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_many_requests_mixed_with_preemption_return_all_blocks():
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=6, budget=24, chunk=10)
    expected = {}
    for i in range(40):
        plen, mt = 1 + (i * 7) % 23, 1 + (i * 5) % 17
        sched.add(make_request(f"r{i}", plen, mt, priority=i % 3, arrival=float(i)))
        expected[f"r{i}"] = expected_tokens(plen, mt)
    assert run_to_completion(sched) == expected
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_free_blocks == 24


def test_eos_and_stop_token_ids_finish():
    from protocol.sampling import SamplingParams
    from tests.worker.engine.fake_runner import EOS
    from worker.engine.request import Request

    sched = make_scheduler()
    r = Request("e", [1, 2], SamplingParams(max_tokens=10), eos_token_ids=frozenset({EOS}))
    sched.add(r)
    out = sched.schedule()
    update(sched, out, [EOS])
    assert r.finish_reason is FinishReason.STOP
    r2 = Request("s", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    sched.add(r2)
    out = sched.schedule()
    update(sched, out, [7])
    assert r2.finish_reason is FinishReason.STOP


def test_higher_priority_request_preempts_a_full_batch():
    """max_num_seqs reached: a waiting request of strictly higher priority (lower value)
    preempts the lowest-priority running one; an equal one waits; outputs stay exact."""
    sched = make_scheduler(max_num_seqs=2, budget=32)
    sched.add(make_request("low-a", prompt_len=4, max_tokens=30, priority=5, arrival=0))
    sched.add(make_request("low-b", prompt_len=4, max_tokens=30, priority=5, arrival=1))
    run_step(sched)
    sched.add(make_request("same", prompt_len=4, max_tokens=3, priority=5, arrival=2))
    out, _ = run_step(sched)
    assert {s.request.request_id for s in out.scheduled} == {"low-a", "low-b"}
    sched.add(make_request("urgent", prompt_len=4, max_tokens=3, priority=-1, arrival=3))
    out, _ = run_step(sched)
    assert {s.request.request_id for s in out.scheduled} == {"low-a", "urgent"}
    assert sched.requests["low-b"].status is RequestStatus.PREEMPTED
    outs = run_to_completion(sched)
    assert outs["urgent"] == expected_tokens(4, 3)
    assert outs["low-b"] == expected_tokens(4, 30)


def test_higher_priority_request_preempts_for_blocks():
    """The pool is full of low-priority work: an urgent request frees blocks by preemption."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8, budget=64, chunk=64)
    sched.add(make_request("low", prompt_len=28, max_tokens=4, priority=3))
    run_step(sched)  # 7 of 8 blocks
    sched.add(make_request("urgent", prompt_len=8, max_tokens=2, priority=-5))
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["urgent"]
    outs = run_to_completion(sched)
    assert outs["urgent"] == expected_tokens(8, 2) and outs["low"] == expected_tokens(28, 4)
