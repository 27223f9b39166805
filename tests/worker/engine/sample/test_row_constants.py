"""The sampler's constants as columns (``sample/rows.py``) answer what the row objects
answer, every step, and the engine draws the same tokens with them as without them:
seeded rows, unseeded ones (the host generator drawn for the same rows in the same
order), greedy rows, penalties, logprobs, a logit bias and filters, in a batch whose
requests end and are replaced (rows change hands), with and without overlap."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.sample.rows import (
    BIAS,
    LOGPROBS,
    MASKED,
    NOT_PLAIN_GREEDY,
    PENALISED,
    SAMPLED,
    SEEDED,
    RowConstants,
)
from worker.engine.sample.sampler import Sampler
from worker.engine.sched import schedule_output
from worker.engine.sched.schedule_output import SchedulerOutput


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("sampling_table"))


def _params(i: int) -> SamplingParams:
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i},
        {"temperature": 0.0},
        {"temperature": 0.7, "top_k": 5},  # unseeded: keys from the host generator
        {"temperature": 1.1, "min_p": 0.05, "seed": i, "frequency_penalty": 0.4},
        {"temperature": 0.9, "seed": 3 * i, "logprobs": 2, "logit_bias": {7: 2.0}},
        {"temperature": 0.0, "logit_bias": {5: 5.0}},
        {"temperature": 0.6, "top_p": 0.8, "allowed_token_ids": list(range(3, 60))},
    ]
    return SamplingParams(max_tokens=3 + i % 6, ignore_eos=True, **kinds[i % len(kinds)])


def _run(path: str, overlap: bool, check: bool) -> list[tuple[int, list[int]]]:
    """Every request's tokens, 24 requests through 6 rows (rows change hands)."""
    engine = Engine(EngineConfig.create(
        path, num_blocks=120, block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
        device="cpu", async_scheduling=overlap, seed=11))
    tables = []
    launch = engine.sampler.launch

    def compared(logits: Any, rows: Any, mask: Any = None,
                 table: RowConstants | None = None) -> Any:
        if check and table is not None:
            _same_answers(table, rows)
            tables.append(table)
        return launch(logits, rows, mask, table)

    engine.sampler.launch = compared  # type: ignore[method-assign,assignment]
    for i in range(24):
        engine.add_request(f"r{i}", [3 + (i * 7 + j) % 50 for j in range(5 + i % 4)],
                           _params(i))
    tokens: dict[int, list[int]] = {}
    by_stream = {s: int(rid[1:]) for rid, s in engine.streams.by_request.items()}
    while engine.has_unfinished_requests():
        batch = engine.step()
        for stream, token in zip(batch.streams, batch.token_ids, strict=True):
            tokens.setdefault(by_stream[stream], []).append(token)
    assert not check or len(tables) > 10
    return sorted(tokens.items())


def _same_answers(table: RowConstants, rows: Any) -> None:
    want = {PENALISED: "penalised", MASKED: "masked", LOGPROBS: "wants_logprobs",
            BIAS: "has_bias"}
    for flag, attr in want.items():
        assert ((table.flags & flag) > 0).tolist() == [bool(getattr(r, attr)) for r in rows]
    assert ((table.flags & NOT_PLAIN_GREEDY) > 0).tolist() == [not r.plain_greedy for r in rows]
    assert ((table.flags & SAMPLED) > 0).tolist() == [not r.greedy for r in rows]
    assert ((table.flags & SEEDED) > 0).tolist() == [r.seed_mix is not None for r in rows]
    assert table.seed_mix.tolist() == [r.seed_mix or 0 for r in rows]
    assert table.output_index.tolist() == [r.output_index for r in rows]
    assert table.params.tobytes() == b"".join(r.params_bytes for r in rows)
    assert table.union == int(np.bitwise_or.reduce(table.flags))


@pytest.mark.parametrize("overlap", [False, True])
def test_the_table_answers_as_the_rows_and_draws_the_same_tokens(
        checkpoint: str, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedule_output, "_TABLE_MIN_ROWS", 1)  # a batch of a few rows too
    with_table = _run(checkpoint, overlap, check=True)
    monkeypatch.setattr(SchedulerOutput, "sampling_rows", lambda self: None)
    assert _run(checkpoint, overlap, check=False) == with_table
    assert len(with_table) == 24


def test_a_full_batch_is_sampled_from_the_table(checkpoint: str) -> None:
    """At the default threshold a batch of 8 or more sampling rows takes the table."""
    engine = Engine(EngineConfig.create(checkpoint, num_blocks=120, block_size=8,
                                        max_num_seqs=10, device="cpu"))
    seen: list[RowConstants | None] = []
    launch = engine.sampler.launch

    def noted(logits: Any, rows: Any, mask: Any = None,
              table: RowConstants | None = None) -> Any:
        seen.append(table)
        return launch(logits, rows, mask, table)

    engine.sampler.launch = noted  # type: ignore[method-assign,assignment]
    for i in range(10):
        engine.add_request(f"r{i}", [3 + i, 4, 5], _params(i))
    for _ in range(3):
        engine.step()
    assert seen and all(t is not None and len(t.flags) == 10 for t in seen)


def test_constant_keys_equal_the_rows_keys_with_unseeded_rows_between() -> None:
    """Seeded, greedy and unseeded rows mixed: the same keys, the generator advanced the
    same way (the next key drawn after them is the same too)."""
    mixes = np.array([5, 0, 0, 9, 0], dtype=np.uint64)
    flags = np.array([SAMPLED | SEEDED, 0, SAMPLED, SAMPLED | SEEDED, SAMPLED], np.uint8)
    table = RowConstants(np.zeros((5, 4), np.float32), mixes,
                          np.array([3, 0, 1, 4, 2], np.int64), flags,
                          int(np.bitwise_or.reduce(flags)))
    rows = [_Row(int(m) if f & SEEDED else None, int(o), not f & SAMPLED)
            for m, o, f in zip(mixes, table.output_index, flags, strict=True)]
    a, b = Sampler(seed=4), Sampler(seed=4)
    assert a.constant_keys(table).tolist() == b.keys(rows).tolist()  # type: ignore[arg-type]
    assert a._rng.getrandbits(64) == b._rng.getrandbits(64)


class _Row:
    def __init__(self, seed_mix: int | None, output_index: int, greedy: bool) -> None:
        self.seed_mix, self.output_index, self.greedy = seed_mix, output_index, greedy
