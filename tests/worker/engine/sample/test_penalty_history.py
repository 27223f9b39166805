"""Penalties keep each request's output history on the host as a growing int64 buffer in
its sampler cache (``logits_processors._output_ids``): step after step, the penalised
logits equal those computed from the whole history afresh, with ids outside the
vocabulary counted in the spare column, and a history that shrank is rebuilt."""

from __future__ import annotations

import random

import torch

from protocol.sampling import SamplingParams
from worker.engine.sample.logits_processors import OUTPUT_IDS, apply_penalties
from worker.engine.sample.sampler import SamplingRow

VOCAB = 40


def _rows(outputs: list[list[int]], caches: list[dict]) -> list[SamplingRow]:
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=0.3,
                             repetition_penalty=1.3), SamplingParams(),
              SamplingParams(frequency_penalty=-0.4)]
    return [SamplingRow(p, len(out), [1, 2, 3], list(out), cache)
            for p, out, cache in zip(params, outputs, caches, strict=True)]


def test_incremental_history_equals_a_fresh_count() -> None:
    rng = random.Random(0)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    outputs: list[list[int]] = [[], [], []]
    caches: list[dict] = [{}, {}, {}]
    for step in range(150):  # past the buffer's first size (64) and one doubling
        for out in outputs:
            out.extend(rng.choice([0, 5, 39, VOCAB + 3, -2]) if rng.random() < 0.1
                       else rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 3])))
        got = apply_penalties(logits.clone(), _rows(outputs, caches))
        want = apply_penalties(logits.clone(), _rows(outputs, [{}, {}, {}]))
        assert torch.equal(got, want), f"step {step}"
    buffer, count = caches[0][OUTPUT_IDS]
    assert count == len(outputs[0]) and len(buffer) >= count
    assert OUTPUT_IDS not in caches[1]  # an unpenalised row keeps nothing


def test_a_shorter_history_is_rebuilt() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    caches: list[dict] = [{}, {}, {}]
    apply_penalties(logits.clone(), _rows([[4] * 30, [], [7] * 30], caches))
    shorter = [[9, 9], [], [8]]
    got = apply_penalties(logits.clone(), _rows(shorter, caches))
    assert torch.equal(got, apply_penalties(logits.clone(), _rows(shorter, [{}, {}, {}])))
