"""Automatic prefix caching with a real model forward: outputs are unchanged by it.

Requests sharing long prefixes, with chunked prefill (hits in the middle of a prompt), a
KV pool small enough to preempt (a recomputed request hits its own blocks), an abort, a
request resumed with ``prior_output_ids`` and a priority mix. Greedy outputs must equal
transformers' ``generate`` on each request alone and, token for token, the same engine
with the cache off; the hit-rate counters must show the sharing; after everything no
block is held (all free or cached-evictable).
"""

from __future__ import annotations

import random

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.test_correctness import assert_matches, reference_greedy
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("prefix-cache"))


def _engine(path: str, caching: bool, num_blocks: int) -> Engine:
    return Engine(EngineConfig.create(
        path, num_blocks=num_blocks, block_size=8, max_num_seqs=6, max_num_batched_tokens=96,
        long_prefill_token_threshold=24, device="cpu", enable_prefix_caching=caching,
    ))


def _workload(vocab: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, priority): three families of shared prefixes, distinct tails."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in (90, 57, 130)]
    jobs = []
    for i in range(18):
        tail = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 12]))]
        jobs.append((prefixes[i % 3] + tail, rng.choice([4, 9, 16]), rng.choice([0, 0, 1, -1])))
    jobs.append((list(prefixes[0]), 6, 0))  # exactly a cached prefix: last token recomputed
    return jobs


def _run(engine: Engine, jobs: list[tuple[list[int], int, int]]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for i, (prompt, max_tokens, priority) in enumerate(jobs):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params, priority=priority)
        outputs[f"r{i}"] = []
        if i % 4 == 3:  # arrivals while others run
            for out in TextOutputs.of(engine).step():
                outputs[out.request_id] += out.new_token_ids
    engine.add_request("gone", jobs[0][0], SamplingParams(max_tokens=30, ignore_eos=True))
    for out in TextOutputs.of(engine).step():
        outputs[out.request_id] += out.new_token_ids
    TextOutputs.of(engine).abort("gone")
    outputs.pop("gone", None)
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            if out.request_id in outputs:
                outputs[out.request_id] += out.new_token_ids
    return outputs


@pytest.mark.parametrize("num_blocks", [200, 36])  # roomy; small enough to preempt
def test_outputs_equal_cache_off_and_transformers(checkpoint: str, num_blocks: int) -> None:
    from transformers import AutoModelForCausalLM

    on, off = _engine(checkpoint, True, num_blocks), _engine(checkpoint, False, num_blocks)
    jobs = _workload(on.runner.shape.vocab_size)
    got, plain = _run(on, jobs), _run(off, jobs)
    assert got == plain
    stats = on.stats()
    assert stats.prefix_cache_hits > 0.5 * sum(len(p) for p, _, _ in jobs[3:])
    assert off.stats().prefix_cache_hits == 0 and off.stats().kv_blocks_cached == 0
    if num_blocks == 36:
        assert stats.num_preemptions > 0
    for engine in (on, off):
        assert engine.stats().kv_blocks_free == num_blocks
        engine.block_manager.check_invariants()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32").eval()
    for i, (prompt, max_tokens, _priority) in enumerate(jobs[:8]):
        want, gaps = reference_greedy(model, prompt, max_tokens)
        assert_matches(got[f"r{i}"], want, gaps, f"r{i}")


def test_resumed_request_hits_its_prompt_and_continues_exactly(checkpoint: str) -> None:
    engine = _engine(checkpoint, True, 200)
    prompt = list(range(5, 120))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = _run(engine, [(prompt, 12, 0)])["r0"]
    hits_before = engine.stats().prefix_cache_hits
    engine.add_request("again", prompt, params, prior_output_ids=full[:5])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            rest += out.new_token_ids
    assert full[:5] + rest == full
    assert engine.stats().prefix_cache_hits - hits_before >= 14 * 8  # the prompt's blocks
