"""Speculative decoding (suffix decoding): the tokens are those of speculation off.

Greedy and seeded rows give identical outputs with speculation on and off, over prompts
that repeat spans (so drafts are accepted) and a second pass of the same prompts (drafts
from the store), with chunked prefill, with preemption on a small KV pool, and with stops
landing inside an accepted run; the block manager's invariants hold after every step, and
the prefix cache only ever registers blocks of verified tokens.
"""

from __future__ import annotations

import random

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.kv.block_manager import chain_hash
from worker.engine.kv.block_partials import partial_key
from worker.engine.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("spec"))


def _engine(path: str, spec: bool, **kw: object) -> Engine:
    opts: dict[str, object] = dict(num_blocks=64, block_size=4, max_num_seqs=8,
                                   max_num_batched_tokens=64, device="cpu",
                                   attention_backend="cpu")
    opts.update(kw)
    if spec:
        # the back-off all but off (test_spec_backoff.py): every weak match drafts, so the
        # verification path runs as often as it can
        opts.update(speculative="suffix", num_speculative_tokens=5, min_match_tokens=1,
                    draft_token_cost=1e-3, draft_step_cost=0.0)
    return Engine(EngineConfig.create(path, **opts))


def _prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        span = [rng.randrange(4, vocab) for _ in range(rng.choice([3, 5, 8]))]
        if i % 3 == 0:
            prompts.append([rng.randrange(4, vocab) for _ in range(rng.choice([2, 9, 30]))])
        else:  # a span repeated: the row's own index drafts its continuation
            prompts.append(span * rng.choice([2, 3, 4]) + span[:2])
    return prompts


def _run(engine: Engine, jobs: list[tuple[str, list[int], SamplingParams]]
         ) -> dict[str, tuple[list[int], str]]:
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    reasons: dict[str, str] = {}
    ids: dict[int, str] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        batch = engine.step()
        engine.scheduler.check_invariants()
        ids.update((opened.stream, opened.request_id) for opened in batch.opened)
        for stream, token in zip(batch.streams, batch.token_ids, strict=True):
            tokens[ids[stream]].append(token)
        for end in batch.ends:
            reasons[ids[end.stream]] = end.finish_reason
    assert not engine.has_unfinished_requests()
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def _jobs(prompts: list[list[int]], params: list[SamplingParams], tag: str
          ) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"{tag}{i}", p, params[i % len(params)]) for i, p in enumerate(prompts)]


def _both(path: str, jobs_list: list[list[tuple[str, list[int], SamplingParams]]],
          **kw: object) -> Engine:
    """Run each list of jobs in turn on one engine per setting; outputs must be equal."""
    off, on = _engine(path, False, **kw), _engine(path, True, **kw)
    for jobs in jobs_list:
        assert _run(on, jobs) == _run(off, jobs)
    assert on.spec is not None and off.spec is None
    return on


GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 24, 40)]
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=m, ignore_eos=True)
          for s, m in ((1, 30), (2, 12), (3, 33))]


def test_greedy_identical_and_drafts_accepted(checkpoint: str) -> None:
    prompts = _prompts(300, 12)
    on = _both(checkpoint, [_jobs(prompts, GREEDY, "a"), _jobs(prompts, GREEDY, "b")])
    stats = on.stats()
    assert stats.spec_draft_rows > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens <= stats.spec_drafted_tokens
    assert stats.spec_mean_acceptance_length > 1.0


def test_seeded_sampling_identical(checkpoint: str) -> None:
    prompts = _prompts(300, 9, seed=5)
    on = _both(checkpoint, [_jobs(prompts, SEEDED, "s"), _jobs(prompts, SEEDED, "t")])
    assert on.stats().spec_draft_rows > 0


def test_chunked_prefill_and_preemption(checkpoint: str) -> None:
    prompts = _prompts(300, 10, seed=7) + [[5 + i % 40 for i in range(70)]]
    jobs = _jobs(prompts, GREEDY + SEEDED, "c")
    on = _both(checkpoint, [jobs, _jobs(prompts, GREEDY, "d")], num_blocks=24,
               max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert on.scheduler.num_preemptions > 0
    assert on.stats().spec_accepted_tokens > 0


def test_stops_inside_an_accepted_run(checkpoint: str) -> None:
    """max_tokens, EOS-like stop ids and min_tokens land wherever the plain run put them."""
    prompts = _prompts(300, 9, seed=11)
    plain = _run(_engine(checkpoint, False), _jobs(prompts, GREEDY[2:], "p"))
    params = []
    for i, (tokens, _) in enumerate(plain.values()):
        stop = tokens[3 + i % 9]
        params.append(SamplingParams(temperature=0, max_tokens=2 + 3 * i, ignore_eos=True,
                                     stop_token_ids=[stop], min_tokens=i % 3))
    jobs = [(f"e{i}", p, params[i]) for i, p in enumerate(prompts)]
    _both(checkpoint, [jobs, [(f"f{i}", p, params[i]) for i, p in enumerate(prompts)]])


def test_excluded_rows_still_identical(checkpoint: str) -> None:
    """Penalised and logprob rows get no drafts but share batches with rows that do."""
    prompts = _prompts(300, 6, seed=3)
    mixed = GREEDY + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                     repetition_penalty=1.3),
                      SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                     logprobs=2)]
    _both(checkpoint, [_jobs(prompts, mixed, "x")])


def test_prefix_cache_holds_only_verified_blocks(checkpoint: str) -> None:
    prompts = _prompts(300, 12, seed=9)
    engine = _engine(checkpoint, True, num_blocks=256)
    out = _run(engine, _jobs(prompts, GREEDY, "v"))
    assert engine.stats().spec_drafted_tokens > engine.stats().spec_accepted_tokens > 0
    bm = engine.block_manager
    valid = set()
    for (rid, prompt, _), (tokens, _) in zip(_jobs(prompts, GREEDY, "v"), out.values(),
                                              strict=True):
        assert rid.startswith("v")
        text, parents, bs = prompt + tokens, [bm._root], bm.block_size
        for i in range(len(text) // bs):
            parents.append(chain_hash(parents[-1], text[i * bs:(i + 1) * bs]))
        valid.update(parents[1:])
        full, kept = divmod(len(text) - 1, bs)  # the last token sampled is never run
        if kept:  # its kept partial block: verified tokens only
            valid.add(partial_key(parents[full], text[full * bs:full * bs + kept]))
    assert bm._block_of and set(bm._block_of) <= valid


def test_settings() -> None:
    cfg = EngineConfig.from_env("m", {"FERRY_SPECULATIVE": "suffix",
                                      "FERRY_NUM_SPECULATIVE_TOKENS": "6",
                                      "FERRY_SPEC_MAX_BATCH": "3"})
    assert cfg.speculative == SpeculativeConfig("suffix", num_speculative_tokens=6,
                                                max_batch_rows=3)
    assert not EngineConfig.create("m").speculative.enabled
    with pytest.raises(ValueError):
        EngineConfig.create("m", speculative="medusa")


def test_overlap_asked_for_turns_speculation_off(checkpoint: str) -> None:
    assert _engine(checkpoint, True, async_scheduling=True).spec is None
    engine = _engine(checkpoint, True)
    assert engine.spec is not None and not engine.overlap


def test_big_batch_backs_off(checkpoint: str) -> None:
    prompts = _prompts(300, 8, seed=2)
    engine = _engine(checkpoint, True, spec_max_batch=2)
    jobs = _jobs(prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], "z")
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    engine.step()  # all eight admitted: too many rows to draft for
    engine.step()
    assert engine.stats().spec_draft_rows == 0


def _run_text(engine: Engine, jobs: list[tuple[str, list[int], SamplingParams]]
              ) -> dict[str, tuple[str, list[int], str | None]]:
    """Through the output side (``TextOutputs``: detokenizing, stop strings), which gets
    several rows of one stream in a step when drafts are accepted."""
    from worker.engine.output.text_output import TextOutputs

    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    got: dict[str, tuple[str, list[int], str | None]] = {rid: ("", [], None)
                                                         for rid, _, _ in jobs}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            text, ids, _ = got[out.request_id]
            got[out.request_id] = (text + out.text, ids + out.new_token_ids,
                                   out.finish_reason)
    return got


def test_stop_strings_on_the_output_side(checkpoint: str) -> None:
    prompts = _prompts(300, 6, seed=13)
    plain = _run_text(_engine(checkpoint, False), _jobs(prompts, GREEDY[1:2], "q"))
    params = []
    for i, (text, _, _) in enumerate(plain.values()):
        cut = text[len(text) // 3:len(text) // 3 + 2] if i % 2 else "\x00never"
        params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                     stop=[cut]))
    jobs = [(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    off, on = _engine(checkpoint, False), _engine(checkpoint, True)
    want = _run_text(off, jobs)
    assert _run_text(on, jobs) == want
    assert any(reason == "stop" for _, _, reason in want.values())
    assert on.stats().spec_accepted_tokens > 0
