"""Drive the scheduler with fake model output: each sampled token is a function of the
request's position, so outputs are deterministic and independent of batching."""

from __future__ import annotations

from protocol.sampling import SamplingParams
from worker.engine.config import SchedulerConfig
from worker.engine.kv.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.sched.scheduler import Scheduler, SchedulerOutput

EOS = 0


def fake_token(request: Request) -> int:
    return 1000 + request.num_tokens  # never EOS


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunk=16,
                   max_model_len=4096, watermark=0.0) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=chunk)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, watermark), max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0,
                 arrival: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, list(range(1, prompt_len + 1)), params, eos_token_ids=frozenset({EOS}),
                   priority=priority, arrival_time=arrival)


def resolve(sched: Scheduler, out: SchedulerOutput,
            sampled: list[int | None]) -> list[tuple[Request, int]]:
    """``resolve_sampled`` for an advanced step's ``sampled`` tokens, aligned with
    ``out.scheduled`` (None where a row samples nothing, or a sampling row gets none).
    Returns (request, token) for each request that got its token."""
    rows = [(s, t) for s, t in zip(out.scheduled, sampled, strict=True) if s.sample]
    if any(t is None for _, t in rows):  # a sampling row without its token gets none
        out = SchedulerOutput([s for s, t in rows if t is not None])
    tokens = [t for _, t in rows if t is not None]
    got = sched.resolve_sampled(out, tokens)
    return list(zip(got.requests, got.tokens, strict=True))


def update(sched: Scheduler, out: SchedulerOutput,
           sampled: list[int | None]) -> list[tuple[Request, int]]:
    """One step whose tokens are known at once: ``advance``, then ``resolve``."""
    sched.advance(out)
    return resolve(sched, out, sampled)


def run_step(sched: Scheduler) -> tuple[SchedulerOutput, list[tuple[Request, int]]]:
    out = sched.schedule()
    check_step(sched, out)
    sampled = [fake_token(s.request) if s.sample else None for s in out.scheduled]
    return out, update(sched, out, sampled)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    seen_prefill = False
    for s in out.scheduled:  # decodes first
        if s.num_new_tokens != 1:
            seen_prefill = True
        else:
            assert not seen_prefill
        bm = sched.block_manager
        need = bm.blocks_needed(s.request.num_computed_tokens + s.num_new_tokens)
        assert len(bm.block_table(s.request.request_id)) >= need
    sched.check_invariants()  # the block manager's, and the rows' mirror of the requests


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    reqs = dict(sched.requests)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    for rid, req in reqs.items():
        outputs[rid] = list(req.output_token_ids)
    return outputs
