"""The sampler's batched penalties (repetition, frequency, presence) against a row-by-row
reference, and the terms no row asks for skipped with the same bits."""

import pytest
import torch

from protocol.sampling import SamplingParams
from worker.engine.sample.logits_processors import apply_penalties
from worker.engine.sample.sampler import SamplingRow

VOCAB = 50


def row(index=0, out=(), prompt=(1, 2), **kw):
    return SamplingRow(SamplingParams(**kw), index, list(prompt), list(out))


def _reference_penalties(logits, rows):
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        counts = torch.zeros(vocab)
        for t in r.output_token_ids:
            if 0 <= t < vocab:
                counts[t] += 1
        x = out[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            for t in r.prompt_token_ids:
                if 0 <= t < vocab:
                    seen[t] = True
            pen = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, pen, x)
        out[i] = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return out


def test_penalties_equal_the_row_by_row_reference():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=gen)
    rows = [row(out=[1, 1, 4, 70, -1], prompt=[2, 3, 99], repetition_penalty=1.3),
            row(out=[], prompt=[5], repetition_penalty=0.8),
            row(out=[7, 7, 7, 8], presence_penalty=0.5, frequency_penalty=0.25),
            row(out=[9], temperature=0),  # no penalty
            row(out=[1, 2, 3] * 5, prompt=list(range(40)), repetition_penalty=1.1,
                presence_penalty=-0.3, frequency_penalty=0.1),
            row(out=[49], frequency_penalty=2.0)]
    got = apply_penalties(logits, rows)
    torch.testing.assert_close(got, _reference_penalties(logits, rows), rtol=0, atol=1e-6)
    assert "prompt_mask" in rows[0].cache and "prompt_mask" not in rows[3].cache
    again = apply_penalties(logits, rows)  # the cached prompt masks give the same
    assert torch.equal(again, got)


def _every_term(logits, rows):
    """The batched formula with every penalty applied, as 1 or 0 where a row has none
    (what apply_penalties computed before it skipped the terms no row asks for)."""
    picked = [r for r in rows if r.penalised]
    index = torch.tensor([i for i, r in enumerate(rows) if r.penalised])
    vocab = logits.shape[1]
    counts = torch.zeros(len(picked), vocab)
    prompts = torch.zeros(len(picked), vocab, dtype=torch.bool)
    for j, r in enumerate(picked):
        for t in r.output_token_ids:
            counts[j, t] += 1
        prompts[j, list(r.prompt_token_ids)] = True
    rep = torch.tensor([r.params.repetition_penalty for r in picked]).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in picked]).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in picked]).unsqueeze(1)
    sub = logits.index_select(0, index)
    sub = torch.where((counts > 0) | prompts, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    return logits.index_copy(0, index, sub)


@pytest.mark.parametrize("kind", [{"frequency_penalty": 0.5}, {"presence_penalty": -0.4},
                                  {"repetition_penalty": 1.2}])
def test_penalties_no_row_asks_for_are_skipped_bit_for_bit(kind):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    logits[1, 5] = float("-inf")
    rows = [row(out=[3, 3, 5, 8], prompt=[5, 6], **kind), row(temperature=0),
            row(out=[5, 1, 1], prompt=[9], **kind), row(out=[2] * 7, **kind)]
    assert torch.equal(apply_penalties(logits, rows), _every_term(logits, rows))
