from types import SimpleNamespace
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from worker.engine.sample.logits_processors import apply_penalties, apply_top_k_top_p_min_p
from worker.engine.sample.sampler import Sampler, SamplingRow

VOCAB = 50


def row(index=0, out=(), prompt=(1, 2), **kw):
    return SamplingRow(SamplingParams(**kw), index, list(prompt), list(out))


def test_greedy_is_argmax():
    logits = torch.randn(3, VOCAB)
    out = Sampler()(logits, [row(temperature=0)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_tokens_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    target = torch.randn(VOCAB)
    mine = row(index=5, seed=1234, temperature=0.9)
    alone = Sampler(seed=1)(target.unsqueeze(0), [mine]).token_ids[0]
    for trial in range(5):
        others = torch.randn(7, VOCAB)
        batch = torch.cat([others[:trial], target.unsqueeze(0), others[trial:]])
        rows = [row(temperature=1.0) for _ in range(trial)] + [mine]
        rows += [row(seed=trial, temperature=1.0) for _ in range(7 - trial)]
        got = Sampler(seed=99 + trial)(batch, rows).token_ids[trial]
        assert got == alone


def test_seeded_sequence_varies_with_index_and_seed():
    logits = torch.zeros(1, VOCAB)  # uniform: draws depend only on the noise
    draws = {Sampler()(logits, [row(index=i, seed=7)]).token_ids[0] for i in range(20)}
    assert len(draws) > 5
    a = [Sampler()(logits, [row(index=i, seed=1)]).token_ids[0] for i in range(10)]
    b = [Sampler()(logits, [row(index=i, seed=2)]).token_ids[0] for i in range(10)]
    assert a != b


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    counts = torch.zeros(VOCAB)
    for i in range(600):
        counts[Sampler()(logits, [row(index=i, seed=3)]).token_ids[0]] += 1
    assert abs(counts[0] / 600 - 0.7) < 0.07 and counts[3:].sum() == 0


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    keep = lambda **kw: torch.isfinite(apply_top_k_top_p_min_p(logits, [row(**kw)]))[0].tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.5) == [True, False, False, False]
    assert keep(top_p=0.7) == [True, True, False, False]
    assert keep(top_p=0.76) == [True, True, True, False]
    assert keep(min_p=0.4) == [True, True, False, False]
    assert keep(top_k=3, top_p=0.9, min_p=0.25) == [True, True, True, False]
    assert keep() == [True] * 4


def test_masks_apply_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 2))
    masked = apply_top_k_top_p_min_p(logits, [row(top_k=1), row()])
    assert torch.isfinite(masked[0]).sum() == 1 and torch.isfinite(masked[1]).sum() == 4


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = apply_penalties(logits, [row(out=[2, 2], prompt=[0, 1], repetition_penalty=2.0)])
    assert out[0].tolist() == [1.0, -4.0, 0.5, 1.0]
    out = apply_penalties(
        logits, [row(out=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)]
    )
    assert out[0].tolist() == pytest.approx([2.0, -2.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25])


def test_logprobs_returned_when_asked():
    logits = torch.randn(2, VOCAB)
    out = Sampler()(logits, [row(temperature=0, logprobs=3), row(temperature=0)])
    chosen, top = out.logprobs[0]
    lp = torch.log_softmax(logits[0], -1)
    assert chosen == pytest.approx(float(lp.max()))
    assert [t for t, _ in top] == lp.topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_logit_bias_bans_and_forces_tokens_for_greedy_and_sampled_rows():
    from worker.engine.sample.logits_processors import apply_logit_bias

    logits = torch.zeros(3, 8)
    logits[:, 2] = 5.0  # the argmax before any bias
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias={2: -100}), 0, [1], []),
        SamplingRow(SamplingParams(temperature=0, logit_bias={6: 100, 1: 3.5}), 0, [1], []),
        SamplingRow(SamplingParams(temperature=1.0, seed=3), 0, [1], []),  # no bias
    ]
    biased = apply_logit_bias(logits, rows)
    assert biased[0, 2] == -95.0 and biased[1, 6] == 100.0 and biased[1, 1] == 3.5
    assert torch.equal(biased[2], logits[2]) and logits[0, 2] == 5.0  # input untouched
    out = Sampler(0)(logits, rows)
    assert out.token_ids[0] != 2 and out.token_ids[1] == 6
    sampled = SamplingParams(temperature=1.0, seed=11, logit_bias={4: 100})
    assert Sampler(0)(torch.randn(1, 8), [SamplingRow(sampled, 0, [1], [])]).token_ids == [4]


def test_sampling_rows_copy_outputs_only_for_penalties():
    from worker.engine.request import Request

    free = Request("a", [1, 2], SamplingParams(temperature=1.0), output_token_ids=[5, 6])
    free.append_placeholder()
    penalised = Request("b", [1, 2], SamplingParams(repetition_penalty=1.2),
                        output_token_ids=[5, 6])
    penalised.append_placeholder()
    # the step in flight: its tokens and each request's row in them (an InflightStep's)
    in_flight: Any = SimpleNamespace(sample=SimpleNamespace(tokens=torch.tensor([9, 7])),
                                     row_of={"a": 0, "b": 1})
    assert SamplingRow.of(free, in_flight).output_token_ids == ()
    assert SamplingRow.of(free, in_flight).pending_output is None
    row = SamplingRow.of(penalised, in_flight)
    assert list(row.output_token_ids) == [5, 6]
    assert row.pending_output is not None and row.pending_output.tolist() == [7]
    assert row.cache is penalised.sampler_cache
    with pytest.raises(RuntimeError, match="pending token"):
        SamplingRow.of(penalised)  # a placeholder needs the step that fills it


# -- against reference implementations ---------------------------------------------------


def _reference_filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The previous implementation, row by row: min-p, then top-k and top-p over one full
    sort, top-p renormalised over what top-k kept."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        x = out[i]
        p = r.params
        if p.min_p > 0:
            probs = torch.softmax(x, -1)
            x = x.masked_fill(probs < probs.max() * p.min_p, float("-inf"))
        k = min(p.top_k, vocab) if p.top_k > 0 else vocab
        if k < vocab or p.top_p < 1.0:
            values, order = x.sort(descending=True)
            drop = torch.arange(vocab) >= k
            probs = torch.softmax(values.masked_fill(drop, float("-inf")), -1)
            drop |= (probs.cumsum(-1) - probs) >= p.top_p
            kept = values.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, order, kept)
        out[i] = x
    return out


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_min_p_equal_the_full_sort_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 300, generator=gen) * 3
    params = [dict(top_k=0), dict(top_k=7), dict(top_p=0.8), dict(top_k=40, top_p=0.5),
              dict(top_k=1000), dict(min_p=0.1), dict(min_p=0.05, top_k=9, top_p=0.95),
              dict(top_k=3, top_p=0.999), dict(), dict(top_k=1), dict(top_p=0.01),
              dict(top_k=300)]
    rows = [row(**kw) for kw in params]
    expected = _reference_filter(logits, rows)
    assert torch.equal(apply_top_k_top_p_min_p(logits, rows), expected)
    no_top_p = [r for r in rows if r.params.top_p == 1.0]  # the topk path, no full sort
    sub = logits[[i for i, r in enumerate(rows) if r.params.top_p == 1.0]]
    assert torch.equal(apply_top_k_top_p_min_p(sub, no_top_p), _reference_filter(sub, no_top_p))


def test_top_k_without_top_p_never_sorts_the_vocabulary(monkeypatch):
    sorted_widths = []
    original = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda t, *a, **k: (
        sorted_widths.append(t.shape[-1]) or original(t, *a, **k)))
    rows = [row(top_k=k, top_p=0.9) for k in (1, 5, 50, 9)]
    apply_top_k_top_p_min_p(torch.randn(4, 1000), rows)
    assert sorted_widths == []
    apply_top_k_top_p_min_p(torch.randn(2, 1000), [row(top_k=5), row(top_p=0.9)])
    assert sorted_widths == [1000]  # a top-p alone needs it


def test_logprobs_of_the_batch_equal_row_by_row():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, VOCAB, generator=gen)
    rows = [row(temperature=0, logprobs=4), row(temperature=0), row(seed=3, logprobs=0),
            row(temperature=0, logprobs=20), row(seed=8, logprobs=1)]
    out = Sampler()(logits, rows)
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            assert out.logprobs[i] is None
            continue
        lp = torch.log_softmax(logits[i], -1)
        chosen, top = out.logprobs[i]
        assert chosen == float(lp[out.token_ids[i]])
        values, ids = lp.topk(r.params.logprobs)
        assert top == list(zip(ids.tolist(), values.tolist(), strict=True))


def test_noise_bits_equal_the_integer_reference():
    """The device draws are SplitMix64 bits, exactly: the same on any device."""
    from kernels import sampling_reference as noise

    keys = [noise.row_key(0, 0), noise.row_key(2**63 - 1, 12345), noise.row_key(7, 3), -1]
    got = noise.uniform(torch.tensor(keys), 300)
    for r, key in enumerate(keys):
        for v in (0, 1, 2, 150, 299):
            bits = noise.mix64(key + v * 0xD1B54A32D192ED03)
            assert got[r, v].item() == float(torch.tensor(((bits >> 41) + 0.5) / 2**23,
                                                          dtype=torch.float32))


def test_noise_is_uniform_and_independent_across_tokens_and_keys():
    from kernels import sampling_reference as noise

    u = noise.uniform(torch.tensor([noise.row_key(s, i) for s in range(8) for i in range(8)]),
                      4096).double()
    assert abs(u.mean().item() - 0.5) < 0.002 and abs(u.var().item() - 1 / 12) < 0.001
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.003
    corr = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(corr.item()) < 0.01


def test_filtered_sampling_follows_the_reference_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [1e-6] * 10]))
    params = dict(top_k=4, top_p=0.75, temperature=1.0)
    expected = torch.softmax(_reference_filter(logits, [row(**params)])[0], -1)
    n = 4000
    counts = torch.zeros(logits.shape[1])
    tokens = Sampler()(logits.expand(n, -1), [row(index=i, seed=77, **params)
                                               for i in range(n)]).token_ids
    for t in tokens:
        counts[t] += 1
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 4 * sigma + 1e-9).all(), (counts / n, expected)
    assert counts[3:].sum() == 0  # top-p 0.75 keeps 0.4 + 0.25 + 0.15 of the top 4


def test_step_keys_equal_the_per_row_keys():
    """``Sampler.keys`` (the seeded rows' keys in one numpy pass) gives each row's
    ``_key`` bit for bit, and draws the unseeded rows' keys in row order as before."""
    import random

    from kernels import sampling_reference as noise

    rng = random.Random(3)
    seeds = [0, 1, 2**63 - 1, *(rng.getrandbits(63) for _ in range(60))]
    rows = [row(index=rng.choice([0, 1, 77, 2**20, 2**40]), temperature=0.7, seed=s)
            for s in seeds]
    rows[5:5] = [row(temperature=0.9), row(index=3), row(index=4, temperature=0.5)]
    one = Sampler(seed=9)
    want = [one._key(r) for r in rows]
    assert Sampler(seed=9).keys(rows).tolist() == want
    mixes = [noise.mix64(s) for s in seeds]
    import numpy as np

    got = noise.keys_at(np.array(mixes, dtype=np.uint64), np.arange(len(seeds)) * 2**33)
    assert got.tolist() == [noise.key_at(m, i * 2**33) for i, m in enumerate(mixes)]
