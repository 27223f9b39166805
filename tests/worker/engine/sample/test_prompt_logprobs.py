"""Prompt logprobs equal transformers' own forward: log_softmax of its logits (fp32).

Every prompt token after the first gets the logprob the model gives it after the tokens
before it (the first gets None), with the top-k alternatives. Checked where the engine
could get it wrong: a prompt split over several chunked-prefill steps (a small token
budget), a prompt whose prefix sits in the prefix cache (the request must compute the
positions it reports instead of taking cached blocks), several requests in one step,
a request preempted and recomputed, and n > 1 (the prompt is reported once).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("prompt-logprobs"))


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _engine(path: str, **kw: Any) -> Engine:
    options: dict[str, Any] = dict(num_blocks=64, block_size=8, max_num_seqs=4,
                                   max_num_batched_tokens=24, long_prefill_token_threshold=24,
                                   device="cpu")
    return Engine(EngineConfig.create(path, **{**options, **kw}))


def _expected(model: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the logprob distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
         ) -> dict[str, list[Any]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got, "prompt logprobs sent twice"
                got[out.request_id] = out.prompt_logprobs
    return got


def _check(entries: list[Any], prompt: list[int], want: torch.Tensor, k: int) -> None:
    assert [e[0] for e in entries] == prompt
    assert entries[0][1] is None and entries[0][2] == []
    for i, (token, logprob, top) in enumerate(entries[1:]):
        assert abs(logprob - float(want[i, token])) < TOL, (i, logprob, float(want[i, token]))
        values, ids = want[i].topk(k)
        assert [t for t, _ in top] == ids.tolist() or \
            max(abs(a - b) for (_, a), b in zip(top, values.tolist(), strict=True)) < TOL
        assert all(abs(p - float(want[i, t])) < TOL for t, p in top)


def test_prompt_logprobs_match_transformers_across_chunks(checkpoint: str, reference: Any) -> None:
    engine = _engine(checkpoint)
    rng = random.Random(3)
    vocab = engine.runner.shape.vocab_size
    prompts = {f"r{n}": [rng.randrange(vocab) for _ in range(n)] for n in (2, 23, 61)}
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    got = _run(engine, {rid: (p, params) for rid, p in prompts.items()})
    assert set(got) == set(prompts)
    for rid, prompt in prompts.items():  # 61 tokens with a budget of 24: three chunks
        _check(got[rid], prompt, _expected(reference, prompt), k=3)
    assert not engine.scoring.pending


def test_prompt_logprobs_with_a_prefix_cache_hit(checkpoint: str, reference: Any) -> None:
    engine = _engine(checkpoint)
    vocab = engine.runner.shape.vocab_size
    rng = random.Random(5)
    shared = [rng.randrange(vocab) for _ in range(40)]
    warm = shared + [rng.randrange(vocab) for _ in range(5)]
    _run(engine, {"warm": (warm, SamplingParams(temperature=0, max_tokens=1))})
    hits_before = engine.block_manager.stats.hits
    prompt = shared + [rng.randrange(vocab) for _ in range(7)]
    got = _run(engine, {"scored": (prompt, SamplingParams(temperature=0, max_tokens=1,
                                                          prompt_logprobs=0))})
    _check(got["scored"], prompt, _expected(reference, prompt), k=0)
    assert engine.block_manager.stats.hits == hits_before, "took cached blocks it must score"
    # a request without prompt logprobs still hits the cache the scored one filled
    _run(engine, {"plain": (prompt + [1], SamplingParams(temperature=0, max_tokens=1))})
    assert engine.block_manager.stats.hits > hits_before


def test_prompt_logprobs_survive_preemption_and_n(checkpoint: str, reference: Any) -> None:
    engine = _engine(checkpoint, num_blocks=14, max_num_batched_tokens=32)
    rng = random.Random(11)
    vocab = engine.runner.shape.vocab_size
    prompts = {f"p{i}": [rng.randrange(vocab) for _ in range(30)] for i in range(3)}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    multi = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=4, prompt_logprobs=1)
    requests = {rid: (p, params) for rid, p in prompts.items()}
    requests["multi"] = (prompts["p0"][:20], multi)
    got = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for rid, (prompt, _) in requests.items():
        _check(got[rid], prompt, _expected(reference, prompt), k=1)
