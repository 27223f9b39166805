"""Scatter new tokens' keys and values into the paged KV cache.

Token t goes to ``slot_mapping[t]``, i.e. block ``slot // block_size`` at offset
``slot % block_size``; a negative slot (padding, or a token whose K/V is already
cached) is skipped. One program per (token, group of KV heads) copies a
``[BLOCK_H, HEAD_DIM_PAD]`` tile of K and of V, converting to the cache dtype.

``key``/``value`` only need a unit stride on head_dim, so they may be views into a
fused QKV projection output; the cache may be any strided view (e.g. one half of a
``[2, num_blocks, ...]`` tensor) as long as K and V share strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _checks as chk
from kernels._attention_core import pow2_at_least

TILE_ELEMENTS = 2048  # elements per program and tensor: enough to keep loads wide


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, Dv]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int32/int64
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    V_DIM: tl.constexpr,
    V_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D]
    offs_v = tl.arange(0, V_DIM_PAD)  # [Dv]
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    mask_v = (offs_h < num_kv_heads)[:, None] & (offs_v < V_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)  # fmt: skip
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :],
                mask=mask_v)  # fmt: skip
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
    dst_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :]  # [H, D]
    dst_v = dst + offs_h[:, None] * stride_ch + offs_v[None, :]  # [H, Dv]
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # e4m3 has no infinity: saturate
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
    tl.store(k_cache_ptr + dst_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, v_head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, v_head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64, negative = skip
) -> None:
    """Triton version of ``kernels.reference.store_kv`` (same semantics, in place)."""
    key = chk.check_tensor("key", key, ndim=3, dtypes=chk.FLOAT_DTYPES)
    value = chk.check_tensor("value", value, ndim=3, dtypes=chk.FLOAT_DTYPES)
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    k_cache = chk.check_tensor("k_cache", k_cache, ndim=4, dtypes=chk.CACHE_DTYPES)
    block_size, num_kv_heads = chk.check_kv_cache(k_cache, v_cache, k_cache.dtype)
    num_tokens, _, head_dim = key.shape
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key is [num_tokens, {key.shape[1]}, {head_dim}] but the cache holds "
            f"[.., {num_kv_heads}, {k_cache.shape[3]}] (num_kv_heads, head_dim)"
        )
    if value.shape[2] != v_cache.shape[3]:
        raise ValueError(f"value head_dim {value.shape[2]} != the cache's {v_cache.shape[3]}")
    chk.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, "
                         f"expected num_tokens={num_tokens}")  # fmt: skip
    chk.check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    if num_tokens == 0:
        return
    head_dim_pad = pow2_at_least(head_dim, 1)
    v_dim = value.shape[2]
    v_dim_pad = pow2_at_least(v_dim, 1)
    block_h = min(pow2_at_least(num_kv_heads, 1),
                  max(1, TILE_ELEMENTS // max(head_dim_pad, v_dim_pad)))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=block_size, BLOCK_H=block_h, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        V_DIM=v_dim, V_DIM_PAD=v_dim_pad, num_warps=4,
    )  # fmt: skip
