"""Triton store_kv against ``kernels.reference.store_kv`` (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.store_kv import store_kv


@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_dim,src_dtype,cache_dtype,slot_dtype",
    [
        (16, 4, 80, torch.float16, torch.float16, torch.int64),
        (1, 1, 64, torch.float32, torch.float32, torch.int32),
        (8, 2, 96, torch.float32, torch.bfloat16, torch.int64),  # converts to the cache dtype
    ],
)
def test_matches_reference_and_skips_negative_slots(
    randn, block_size, num_kv_heads, head_dim, src_dtype, cache_dtype, slot_dtype
):
    num_blocks, num_tokens = 8, 7
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    # key/value as views into one fused [T, 3 * Hkv, D] projection output (strided rows)
    fused = randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=src_dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4]] = -1  # skipped tokens (padding / already cached)
    slots = slots.to(dtype=slot_dtype, device=key.device)

    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    before_k = k_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)

    if src_dtype == cache_dtype:  # a pure copy: bit-exact
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, CUDA to nearest: 1 ulp
        torch.testing.assert_close(k_cache, want_k, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_cache, want_v, atol=0, rtol=2**-7)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    flat_before = before_k.view(-1, num_kv_heads, head_dim)
    flat_after = k_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_after[~written], flat_before[~written])  # other slots untouched


def test_cache_as_views_of_one_tensor(randn, device):
    """K and V halves of one [2, num_blocks, ...] allocation (shared strides)."""
    kv = torch.zeros(2, 3, 8, 2, 64, device=device)
    key, value = randn(5, 2, 64), randn(5, 2, 64)
    slots = torch.tensor([0, 9, -3, 23, 17], device=key.device)
    store_kv(key, value, kv[0], kv[1], slots)
    want = torch.zeros_like(kv)
    reference.store_kv(key, value, want[0], want[1], slots)
    assert torch.equal(kv, want)


def _good_args(device: torch.device) -> dict:
    return {
        "key": torch.zeros(3, 2, 64, device=device),
        "value": torch.zeros(3, 2, 64, device=device),
        "k_cache": torch.zeros(4, 8, 2, 64, device=device),
        "v_cache": torch.zeros(4, 8, 2, 64, device=device),
        "slot_mapping": torch.zeros(3, dtype=torch.long, device=device),
    }


# name -> (argument overrides built from the good arguments, expected message fragment)
BAD_INPUTS = {
    "key/value shapes": (lambda a: {"value": a["value"][:2]}, "key and value shapes differ"),
    "heads": (lambda a: {"key": a["key"].new_zeros(3, 1, 64), "value": a["key"].new_zeros(3, 1, 64)}, "num_kv_heads"),  # noqa: E501
    "slot count": (lambda a: {"slot_mapping": a["slot_mapping"][:2]}, "slot_mapping has 2"),
    "slot dtype": (lambda a: {"slot_mapping": a["slot_mapping"].float()}, "slot_mapping must"),
    "cache rank": (lambda a: {"k_cache": a["k_cache"][0]}, "k_cache must be 4-D"),
    "strided key": (lambda a: {"key": a["key"].new_zeros(3, 2, 64, 2)[..., 0]}, "key must be"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_value_error(device, name):
    args = _good_args(device)
    overrides, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        store_kv(**(args | overrides(args)))
