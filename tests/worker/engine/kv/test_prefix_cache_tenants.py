"""The prefix cache is partitioned (protocol/tenants/cache_scope.py): no lookup crosses scopes.

A real model forward on CPU. Tenant B sending the prompt tenant A just sent finds nothing
cached (the hit that made its first token come 50 times sooner was the oracle), while A's
repeat hits; a different ``cache_salt`` within a tenant misses and the same one hits; two
tenants of one operator's ``prefix_cache_group`` share; and the same holds for kept
partial blocks and for blocks the host tier holds. Each request's ``num_cached_tokens``
(what its usage reports) is read from its final output.
"""

from __future__ import annotations

import random

import pytest

from protocol.sampling import SamplingParams
from protocol.tenants.cache_scope import cache_partition
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

BS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("prefix-tenants"))


def _engine(path: str, num_blocks: int = 64, host_bytes: int | None = None) -> Engine:
    return Engine(EngineConfig.create(
        path, num_blocks=num_blocks, block_size=BS, max_num_seqs=4,
        max_num_batched_tokens=256, device="cpu", host_memory_bytes=host_bytes))


def _scope(tenant: str | None, salt: str | None = None, group: str | None = None
           ) -> str | None:
    return cache_partition(tenant, group, salt)


class _Runner:
    """Runs one request at a time to its end; remembers its tokens and cached count."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.n = 0

    def run(self, prompt: list[int], scope: str | None, max_tokens: int = 2
            ) -> tuple[int, list[int]]:
        self.n += 1
        rid = f"r{self.n}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_tokens(rid, prompt, params, cache_scope=scope)
        tokens: list[int] = []
        cached = None
        while self.engine.has_unfinished_requests():
            for out in TextOutputs.of(self.engine).step():
                tokens += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == "length"
                    cached = out.num_cached_tokens
        assert cached is not None
        self.engine.block_manager.check_invariants()
        return cached, tokens


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, engine.runner.shape.vocab_size) for _ in range(n)]


def test_another_tenant_never_hits_a_tenants_prompt(checkpoint: str) -> None:
    engine = _engine(checkpoint)
    run = _Runner(engine).run
    p = _prompt(engine, 5 * BS, 1)  # 5 full blocks; the last token is always computed
    cached_a, tokens_a = run(p, _scope("a"))
    assert cached_a == 0
    cached_b, tokens_b = run(p, _scope("b"))
    assert cached_b == 0 and tokens_b == tokens_a  # computed anew, the same answer
    assert run(p, _scope("a"))[0] == 4 * BS  # A's repeat hits its own blocks...
    assert run(p, _scope("b"))[0] == 4 * BS  # ...and B's its own
    assert run(p, None)[0] == 0  # the default tenant's space is neither
    assert run(p, _scope(None))[0] == 4 * BS and run(p, _scope("default"))[0] == 4 * BS


def test_cache_salt_isolates_within_a_tenant(checkpoint: str) -> None:
    run = _Runner(_engine(checkpoint)).run
    p = _prompt(run.__self__.engine, 4 * BS + 3, 2)  # type: ignore[attr-defined]
    assert run(p, _scope("a"))[0] == 0
    assert run(p, _scope("a", salt="s1"))[0] == 0  # a salt is a space of its own
    assert run(p, _scope("a", salt="s2"))[0] == 0
    assert run(p, _scope("b", salt="s1"))[0] == 0  # the same salt in another tenant
    assert run(p, _scope("a", salt="s1"))[0] == 4 * BS  # the same salt hits
    assert run(p, _scope("a"))[0] == 4 * BS


def test_a_prefix_cache_group_shares_and_only_it(checkpoint: str) -> None:
    run = _Runner(_engine(checkpoint)).run
    p = _prompt(run.__self__.engine, 3 * BS + 1, 3)  # type: ignore[attr-defined]
    assert run(p, _scope("a", group="public"))[0] == 0
    assert run(p, _scope("b", group="public"))[0] == 3 * BS  # shared on purpose
    assert run(p, _scope("a"))[0] == 0  # a's own space is not the group's
    assert run(p, _scope("public"))[0] == 0  # nor is a tenant named like the group
    assert run(p, _scope("b", salt="x", group="public"))[0] == 0  # a salt still narrows it


def _turn(run: object, engine: Engine, seed: int, scope: str | None
          ) -> tuple[list[int], list[int]]:
    """A short first turn (under a block: only a kept partial block remains of it), run
    in ``scope``; its follow-up prompt: prompt, answer and a new message."""
    first = _prompt(engine, 5, seed)
    _, answer = run(first, scope, max_tokens=3)  # type: ignore[operator]
    return first, first + answer + _prompt(engine, 4, seed + 100)


def test_kept_partial_blocks_honour_the_scope(checkpoint: str) -> None:
    engine = _engine(checkpoint)
    run = _Runner(engine).run
    _first, follow = _turn(run, engine, 4, _scope("a"))
    assert run(follow, _scope("a"))[0] == 7  # the partial block: 5 + 3 - 1 computed
    _first, follow = _turn(run, engine, 5, _scope("a"))
    assert run(follow, _scope("b"))[0] == 0  # looked up before anything evicts it
    _first, follow = _turn(run, engine, 6, _scope("a", salt="s"))
    assert run(follow, _scope("a"))[0] == 0


def test_host_tier_lookups_honour_the_scope(checkpoint: str) -> None:
    """A 12-block pool with a host tier: a filler request pushes A's blocks out to the
    host; B's lookup (before its own allocation evicts anything) must not find them
    there, A's must."""
    engine = _engine(checkpoint, num_blocks=12, host_bytes=64 << 20)
    tier = engine.block_manager.tier
    assert tier is not None
    run = _Runner(engine).run
    p = _prompt(engine, 5 * BS, 7)
    filler = _prompt(engine, 10 * BS, 8)
    assert run(p, _scope("a"))[0] == 0
    assert run(filler, _scope("c"))[0] == 0
    assert tier.num_cached >= 5  # A's full blocks were evicted through the tier
    before = tier.stats.hit_tokens
    assert run(p, _scope("b"))[0] == 0 and tier.stats.hit_tokens == before
    run(filler, _scope("c"))  # B's blocks took the pool: A's are on the host only
    before = tier.stats.hit_tokens
    assert run(p, _scope("a"))[0] == 4 * BS and tier.stats.hit_tokens == before + 4 * BS
    # a kept partial block evicted to the host: the same rule
    _first, follow = _turn(run, engine, 9, _scope("a"))
    run(filler, _scope("c"))
    before = tier.stats.hit_tokens
    assert run(follow, _scope("b"))[0] == 0 and tier.stats.hit_tokens == before
    _first, follow = _turn(run, engine, 10, _scope("a"))
    run(filler, _scope("c"))
    before = tier.stats.hit_tokens
    assert run(follow, _scope("a"))[0] == 7 and tier.stats.hit_tokens == before + 7
