"""The Triton fused-MoE kernel equals the naive per-expert loop of ``kernels.reference``.

Routings with experts no token chose, one token, top-1/2/4, more pairs of one expert
than a program's block; bf16/fp32 experts and FP8 and INT8 experts with per-feature scales;
feature sizes that are not multiples of the kernel's blocks.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.moe.fused import BLOCK_M, FP8, fused_moe, moe_align

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
EXPERTS, HIDDEN, INTER = 6, 40, 24


def _routing(tokens: int, top_k: int, *, only: list[int] | None, seed: int):
    """[T, K] distinct expert ids per token (from ``only`` if given) and softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(only if only is not None else list(range(EXPERTS)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]]
                       for _ in range(tokens)]) if tokens else torch.zeros(0, top_k)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return ids.to(torch.int32), weights


CASES = {
    "one_token_top1": (1, 1, None),
    "one_token_top4": (1, 4, None),
    "empty_experts_top2": (5, 2, [1, 4]),  # experts 0, 2, 3, 5 get nothing
    "long_run_top2": (3 * BLOCK_M, 2, [0, 2, 5]),  # several blocks of one expert
    "batch_top4": (9, 4, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_per_expert_loop(device, randn, dtype, case) -> None:
    tokens, top_k, only = CASES[case]
    ids, weights = _routing(tokens, top_k, only=only, seed=len(case))
    x = randn(tokens, HIDDEN, dtype=dtype)
    w13 = randn(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype) / HIDDEN ** 0.5
    w2 = randn(EXPERTS, HIDDEN, INTER, dtype=dtype) / INTER ** 0.5
    got = fused_moe(x, w13, w2, ids.to(device), weights.to(device, dtype))
    want = reference.moe_experts(x.cpu(), w13.cpu(), w2.cpu(), ids, weights.to(dtype))
    atol, rtol = TOL[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)


def _quantized(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8: the values rounded to e4m3; int8: integers in [-127, 127]."""
    return w.to(FP8) if dtype == FP8 else (w * 40).round().clamp(-127, 127).to(torch.int8)


@pytest.mark.parametrize("wdtype", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_scaled_experts_match_dequantized_loop(device, randn, dtype, top_k, wdtype) -> None:
    ids, weights = _routing(7, top_k, only=[0, 1, 3, 5], seed=top_k)
    x = randn(7, HIDDEN, dtype=dtype)
    w13 = _quantized(randn(EXPERTS, 2 * INTER, HIDDEN), wdtype)
    w2 = _quantized(randn(EXPERTS, HIDDEN, INTER), wdtype)
    unit = 1 / 40 if wdtype == torch.int8 else 1.0  # int8 holds the values x40
    s13 = ((torch.rand(EXPERTS, 2 * INTER) / HIDDEN ** 0.5 + 0.01) * unit).to(device)
    s2 = ((torch.rand(EXPERTS, HIDDEN) / INTER ** 0.5 + 0.01) * unit).to(device)
    got = fused_moe(x, w13, w2, ids.to(device), weights.to(device, dtype), s13, s2)
    want = reference.moe_experts(x.cpu(), w13.cpu(), w2.cpu(), ids, weights.to(dtype),
                                 s13.cpu(), s2.cpu())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)


def test_align_pads_each_expert_to_whole_blocks(device) -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=device)  # pairs 0..5
    pairs, block_expert = moe_align(ids, 4, block_m=4)
    sentinel = 6
    assert pairs.tolist()[:12] == [1, 4, sentinel, sentinel, 3, sentinel, sentinel, sentinel,
                                   0, 2, 5, sentinel]
    assert block_expert.tolist()[:3] == [0, 1, 2]
    assert set(block_expert.tolist()[3:]) <= {-1}
    assert set(pairs.tolist()[12:]) <= {sentinel}


def test_no_tokens_gives_empty_output(device, randn) -> None:
    w13, w2 = randn(2, 8, 4), randn(2, 4, 4)
    out = fused_moe(randn(0, 4), w13, w2, torch.zeros(0, 2, dtype=torch.int32, device=device),
                    randn(0, 2))
    assert out.shape == (0, 4)


def test_launcher_refuses_bad_shapes(device, randn) -> None:
    x, ids, w = randn(3, 8), torch.zeros(3, 2, dtype=torch.int32, device=device), randn(3, 2)
    with pytest.raises(ValueError, match="expert shapes"):
        fused_moe(x, randn(4, 10, 8), randn(4, 8, 4), ids, w)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe(x, randn(4, 8, 8), randn(4, 8, 4), ids, randn(3, 1))
    with pytest.raises(ValueError, match="w13_scale must be given"):
        fused_moe(x, randn(4, 8, 8).to(FP8), randn(4, 8, 4), ids, w)
