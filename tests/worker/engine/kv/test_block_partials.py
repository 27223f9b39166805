"""Partly filled last blocks in the prefix cache (``block_partials.py``).

Unit level: a request finishing inside a block leaves that block cached under its tokens;
a request repeating them takes it (device) or a copy of it (host tier) and computes from
the token after them; only the leading tokens are matched, a taken block leaves the cache.
Engine level: multi-turn conversations (each turn's prompt the previous prompt and answer
plus a message) give the same greedy tokens with the prefix cache off, on, and on over a
small pool with the host tier, where the returning turns took partial blocks.
"""

from __future__ import annotations

import random

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.kv.test_kv_host_tier import BS, _cached_then_freed, _fill, _request
from worker import Engine, EngineConfig
from worker.engine.kv.block_manager import BlockManager
from worker.engine.kv.block_partials import PartialHit
from worker.engine.output.text_output import TextOutputs


def _finished(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Request "a" of ``tokens`` computed but its last (sampled) token, then finished;
    returns its table."""
    a = _request("a", tokens)
    assert bm.allocate_slots("a", len(tokens), cached=bm.cached_prefix(a)) is not None
    a.num_computed_tokens = len(tokens)  # the last one too: only len - 1 count
    bm.cache_full_blocks(a, len(tokens))
    table = list(bm.block_table("a"))
    bm.free_keeping_partial(a)
    return table


def test_a_partial_block_is_taken_by_the_next_turn() -> None:
    bm = BlockManager(8, BS, watermark=0)
    table = _finished(bm, list(range(15)))  # 3 full blocks, 2 computed tokens in the 4th
    nxt = _request("b", [*range(14), 99, 98, 97])  # a's computed tokens, then new ones
    hits = bm.cached_prefix(nxt)
    partial = hits[3]
    assert hits[:3] == table[:3] and isinstance(partial, PartialHit)
    assert (partial.tokens, partial.block) == (2, table[3])
    assert bm.hit_tokens(hits) == 14
    assert bm.allocate_slots("b", 17, cached=hits) is not None
    assert bm.block_table("b")[:4] == table[:4] and bm.num_cached_blocks == 3
    bm.check_invariants()
    nxt.num_computed_tokens = 17
    bm.cache_full_blocks(nxt, 17)  # the taken block is registered once it is full
    assert bm.num_cached_blocks == 4
    bm.check_invariants()


def test_only_the_same_leading_tokens_match() -> None:
    bm = BlockManager(8, BS, watermark=0)
    _finished(bm, list(range(15)))
    assert len(bm.cached_prefix(_request("b", [*range(12), 7, 13, 5]))) == 3  # token 12
    # one of the kept block's two tokens: a partial block matches whole or not at all
    assert len(bm.cached_prefix(_request("c", [*range(13), 50]))) == 3
    bm.check_invariants()


def test_aborted_and_unfinished_requests_keep_nothing_partial(checkpoint: str) -> None:
    engine = _engine(checkpoint, 64, 0)
    engine.add_request("x", list(range(3, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    TextOutputs.of(engine).step()
    TextOutputs.of(engine).abort("x")
    assert engine.block_manager.num_cached_blocks == 27 // 8  # the full blocks alone


def test_a_partial_block_comes_back_from_the_host_tier() -> None:
    pool, bm, tier, _ = _cached_then_freed(10, 8)  # "a": 2 full blocks, freed
    table = _finished(bm, [*range(8), 40, 41, 42])  # 2 cached + 2 of 3 tokens kept
    _fill(pool, table, 20.0)
    kept = pool[:, :, table[2]].clone()
    other = _request("o", list(range(100, 116)))  # 4 full blocks: evicts all of a's
    assert bm.allocate_slots("o", 16, cached=bm.cached_prefix(other)) is not None
    bm.flush_copies(pool)
    bm.free("o")
    hits = bm.cached_prefix(_request("c", [*range(8), 40, 41, 60, 61]))
    assert isinstance(hits[-1], PartialHit) and hits[-1].block is None
    assert bm.hit_tokens(hits) == 10
    assert bm.allocate_slots("c", 12, cached=hits) is not None
    bm.flush_copies(pool)
    assert torch.equal(pool[:, :, bm.block_table("c")[2]], kept)
    assert tier.stats.restored == 3
    bm.check_invariants()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("partials"))


def _engine(path: str, num_blocks: int, host_bytes: int, caching: bool = True) -> Engine:
    return Engine(EngineConfig.create(
        path, num_blocks=num_blocks, block_size=8, max_num_seqs=4, max_num_batched_tokens=96,
        long_prefill_token_threshold=48, device="cpu", host_memory_bytes=host_bytes,
        enable_prefix_caching=caching))


def _conversations(engine: Engine, vocab: int) -> dict[str, list[int]]:
    """3 conversations of 3 turns, served round by round, each turn alone."""
    rng = random.Random(11)
    history: list[list[int]] = [[] for _ in range(3)]
    outs: dict[str, list[int]] = {}
    for turn in range(3):
        for c in range(3):
            prompt = history[c] + [rng.randrange(3, vocab) for _ in range(13)]
            rid = f"c{c}t{turn}"
            engine.add_request(rid, prompt, SamplingParams(max_tokens=11, temperature=0,
                                                           ignore_eos=True))
            outs[rid] = []
            while engine.has_unfinished_requests():
                for out in TextOutputs.of(engine).step():
                    outs[rid] += out.new_token_ids
            history[c] = prompt + outs[rid]
    return outs


def test_conversations_equal_with_partial_blocks(checkpoint: str) -> None:
    off = _engine(checkpoint, 200, 0, caching=False)
    vocab = off.runner.shape.vocab_size
    want = _conversations(off, vocab)
    roomy, small = _engine(checkpoint, 200, 0), _engine(checkpoint, 12, 64 << 20)
    assert _conversations(roomy, vocab) == want and _conversations(small, vocab) == want
    roomy.block_manager.check_invariants()
    small.block_manager.check_invariants()
    # partial blocks were taken: from the tier (on the device, a partial block is the
    # first evicted, so the next conversation's turn reuses it)
    hits = small.block_manager.stats.hits
    assert hits % 8 != 0, hits
    assert small.block_manager.tier is not None and small.block_manager.tier.stats.restored
