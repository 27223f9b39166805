"""The one-pass resolve of accepted runs (``speculative/resolve.py``) against the
per-position loop it replaced: the same cut of each run (``run_length`` against
``Request.check_token_stop`` token by token), and step for step the same ``StepBatch``es
(rows in the same order, the same ends at the same rows) and the same counters."""

from __future__ import annotations

import random
from typing import Any

import pytest

import worker.engine.speculative.engine_hooks as hooks
from ops.bench.techniques.spec_resolve import per_position
from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.speculative.test_spec_decode import _engine, _prompts
from worker.engine.output.step_batch import StepBatch
from worker.engine.request import Request
from worker.engine.speculative.resolve import run_length


def _request(rng: random.Random) -> Request:
    most = rng.randint(1, 12)
    params = SamplingParams(max_tokens=most, min_tokens=min(most, rng.choice([0, 0, 2, 5])),
                            ignore_eos=rng.random() < 0.3,
                            stop_token_ids=rng.sample(range(10), rng.randint(0, 2)))
    prompt = [rng.randrange(10, 20) for _ in range(rng.randint(1, 6))]
    request = Request("r", prompt, params, eos_token_ids=frozenset({rng.randrange(10)}))
    for _ in range(rng.randint(0, params.max_tokens - 1)):
        request.append_output_token(rng.randrange(10, 20))
    return request


def test_run_length_is_check_token_stop_per_token() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        request, max_model_len = _request(rng), rng.randint(8, 40)
        if request.num_tokens >= max_model_len:
            continue
        tokens = [rng.randrange(12) for _ in range(rng.randint(1, 8))]
        copy = Request("c", list(request.prompt_token_ids), request.params,
                       eos_token_ids=request.eos_token_ids)
        for token in request.output_token_ids:
            copy.append_output_token(token)
        want: tuple[int, Any] = (len(tokens), None)
        for i, token in enumerate(tokens):
            copy.append_output_token(token)
            reason = copy.check_token_stop(token, max_model_len)
            if reason is not None:
                want = (i + 1, reason)
                break
        assert run_length(request, tokens, max_model_len) == want


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("resolve"))


def _steps(engine: Any, jobs: list[tuple[str, list[int], SamplingParams]]) -> list[Any]:
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        batch = engine.step()
        engine.scheduler.check_invariants()
        steps.append((batch.streams, batch.token_ids, batch.logprobs,
                      [(e.stream, e.finish_reason, e.stop_reason, e.num_output_tokens, e.row)
                       for e in batch.ends]))
    return steps


def test_same_batches_asper_position(checkpoint: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(300, 12, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * (i % 6), ignore_eos=True,
                             stop_token_ids=[7 + i % 5, 40 + i], min_tokens=i % 4)
              for i in range(len(prompts))]
    jobs = [(f"a{i}", p, params[i]) for i, p in enumerate(prompts)]
    retries = [(f"b{i}", p, params[i]) for i, p in enumerate(prompts)]
    new = _engine(checkpoint, True)
    got = _steps(new, jobs) + _steps(new, retries)
    monkeypatch.setattr(hooks, "resolve_rest", per_position)
    old = _engine(checkpoint, True)
    assert got == _steps(old, jobs) + _steps(old, retries)
    assert new.stats() == old.stats() and new.tokens_generated == old.tokens_generated
    assert new.stats().spec_accepted_tokens > 0


def _recorded(llm: Any, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    """``llm.generate``'s outputs and every step's batch (rows, ends) on the way."""
    engine, batches = llm.engine, []
    step = engine.step

    def record() -> StepBatch:
        batch = step()
        if batch.streams or batch.ends:  # not the steps waiting for a grammar (timing)
                batches.append((batch.streams, batch.token_ids,
                            [(e.stream, e.finish_reason, e.error, e.row) for e in batch.ends]))
        return batch

    engine.step = record
    outs = llm.generate(prompts, params)
    return [[(o.token_ids, o.finish_reason) for o in outs], batches]


def test_grammar_rows_same_asper_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON-schema rows (test_spec_grammar.py's), whose grammar ends inside accepted runs:
    the same batches, outputs and counters as the per-position loop."""
    from tests.worker.engine.speculative.test_spec_grammar import REPEATED, _params
    from worker import LLM

    opts: dict[str, Any] = dict(device="cpu", kv_cache_blocks=256, max_num_seqs=8,
                                speculative="suffix", num_speculative_tokens=8,
                                min_match_tokens=1)
    params = _params()
    got, new = [], LLM(**opts)
    for _ in range(2):  # the second pass drafts from the store too
        got += _recorded(new, [REPEATED] * len(params), params)
    monkeypatch.setattr(hooks, "resolve_rest", per_position)
    want, old = [], LLM(**opts)
    for _ in range(2):
        want += _recorded(old, [REPEATED] * len(params), params)
    assert got == want
    assert new.engine.stats() == old.engine.stats()
    assert new.engine.stats().spec_accepted_tokens > 0
