import pytest
import torch

from protocol.sampling import SamplingParams
from worker.engine.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p

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
    from worker.engine.sampler import apply_logit_bias

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
