"""n > 1 and best_of in the engine, on the shipped default model: the candidates share the
prompt through the prefix cache, seeded choices are reproducible and batch-independent,
best_of returns the n best by cumulative logprob."""

from __future__ import annotations

import pytest

from protocol.sampling import SamplingParams
from worker import LLM
from worker.engine.choices import derive_seed
from worker.engine.output.text_output import TextOutputs

PROMPT = "def parse_config(path):\n    "


@pytest.fixture(scope="module")
def llm() -> LLM:
    import torch

    torch.set_num_threads(1)
    return LLM(device="cpu", kv_cache_blocks=512)


def test_greedy_choices_are_identical_and_the_prompt_is_prefilled_once(llm: LLM) -> None:
    before = llm.engine.stats()
    [out] = llm.generate(PROMPT * 4, SamplingParams(n=4, temperature=0, max_tokens=12))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) == 1 and out.text == out.choices[0].text
    after = llm.engine.stats()
    prompt = len(out.prompt_token_ids)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert queries == 4 * prompt
    full_blocks = (prompt - 1) // 16 * 16
    assert hits >= 3 * full_blocks  # choices 1-3 took every full block of choice 0's prompt


def test_seeded_choices_are_distinct_reproducible_and_batch_independent(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=16)
    [first] = llm.generate(PROMPT, params)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1
    noise = [PROMPT + str(i) for i in range(5)]  # a different batch around it
    outs = llm.generate([*noise, PROMPT], [SamplingParams(max_tokens=8)] * 5 + [params])
    assert [c.text for c in outs[-1].choices] == texts
    for i in range(4):  # choice i is exactly a single request with the derived seed
        alone = SamplingParams(temperature=1.0, seed=derive_seed(1234, i), max_tokens=16)
        assert llm.generate(PROMPT, alone)[0].text == texts[i]


def test_best_of_returns_the_n_best_by_cumulative_logprob(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=9, max_tokens=10)
    [out] = llm.generate(PROMPT, params)
    assert [c.index for c in out.choices] == [0, 1]
    scores = [c.cumulative_logprob for c in out.choices]
    assert all(s is not None for s in scores) and scores[0] >= scores[1]  # type: ignore[operator]
    assert out.choices[0].logprobs is None  # computed for ranking, not reported
    every = [SamplingParams(temperature=1.0, seed=derive_seed(9, i), max_tokens=10,
                            logprobs=0) for i in range(5)]
    singles = llm.generate([PROMPT] * 5, every)
    totals = sorted((sum(lp for lp, _ in s.logprobs or []), s.text) for s in singles)
    assert [text for _, text in totals[::-1][:2]] == [c.text for c in out.choices]


def test_aborting_a_request_aborts_every_candidate(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("many", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    TextOutputs.of(engine).step()
    finals = TextOutputs.of(engine).abort("many")
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.finished and o.request_id == "many" for o in finals)
    assert not engine.has_unfinished_requests()
    assert TextOutputs.of(engine).abort("many") == []


def test_bad_n_and_best_of_are_refused() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=0)
