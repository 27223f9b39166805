"""Paged decode attention on the CPU: the C++ kernel in ``csrc/paged_decode_cpu.cpp``.

Decode on a CPU is bound by moving K/V. This kernel reads each sequence's pages in
place, exactly up to its own length (no gathered copy, no padding to the batch's longest
sequence), prefetching the next page from the block table, and keeps the online softmax
in fp32. Measured on the 2-core dev machine (32 sequences of 400-720 tokens, GQA 8:4,
head dim 64, fp32 cache, one layer, 2 threads): 2.2 ms (17 GB/s of K/V), against 9.9 ms
for gather + SDPA and 44 ms for the reference (``ops/bench/engine/cpu_ops.py``).

Equal to ``kernels.reference.paged_decode_attention`` within fp32 rounding, sliding
window, logit soft cap, attention sinks and chunked local attention included. The cache
may be float32 or bfloat16; queries of any float dtype are computed in fp32 and the
output has the query's dtype.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kernels import _checks as chk
from kernels.native_build import NativeBuildError, load

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
# the kernel's cache-type code: 0 float32, 1 bfloat16, 2 FP8 e4m3 (unit scale)
_CACHE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ERRORS = {
    1: "bad shapes",
    2: "a seq_len is < 1 or longer than its block table row holds",
    3: "a block table entry in use is not a block of the cache",
}


@functools.cache
def _kernel() -> Callable[..., int]:
    fn = load("paged_decode_cpu.cpp").ferry_paged_decode
    fn.restype = _I
    fn.argtypes = [_P, _P, _P, _I64, _P, _I64, _I64, _P, _P,
                   _I, _I, _I, _I, _I, _F, _I, _F, _I, _P, _I]
    return fn  # type: ignore[no-any-return]


def unavailable_reason() -> str | None:
    """None when the kernel builds and loads here (a C++ compiler is needed), else why."""
    try:
        _kernel()
    except NativeBuildError as exc:
        return str(exc)
    return None


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the current token
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits
    chunk_size: int | None = None,  # chunked local attention
) -> torch.Tensor:
    """One query token per sequence over its paged context; returns [S, Hq, D]."""
    chk.check_tensor("q", q, ndim=3, dtypes=chk.FLOAT_DTYPES)
    k = chk.check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES)
    v = chk.check_tensor("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k_cache and v_cache differ: {tuple(k.shape)} {k.dtype} vs "
                         f"{tuple(v.shape)} {v.dtype}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k.shape
    chk.check_heads(num_q_heads, num_kv_heads, head_dim, kv_dim)
    chk.check_block_tables(block_tables, seq_lens, num_seqs)
    chk.check_same_device(q=q, k_cache=k, v_cache=v, block_tables=block_tables,
                          seq_lens=seq_lens)
    if q.device.type != "cpu":
        raise ValueError(f"the CPU kernel needs CPU tensors, got {q.device}")
    q32 = q.to(torch.float32).contiguous()
    lens = seq_lens.contiguous()
    sinks32 = chk.sinks_arg(sinks, num_q_heads, q.device)
    res = torch.empty_like(q32)
    rc = _kernel()(
        q32.data_ptr(), k.data_ptr(), v.data_ptr(), num_blocks, block_tables.data_ptr(),
        block_tables.shape[1], block_tables.stride(0), lens.data_ptr(), res.data_ptr(),
        num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, float(scale),
        chk.window_arg(sliding_window), chk.soft_cap_arg(logits_soft_cap),
        _CACHE_CODE[k.dtype], None if sinks32 is None else sinks32.data_ptr(),
        chk.window_arg(chunk_size),
    )
    if rc != 0:
        raise ValueError(f"paged_decode_attention (cpu): {_ERRORS.get(rc, f'error {rc}')}")
    if out is not None:
        chk.check_out(out, q)
        out.copy_(res)
        return out
    return res if q.dtype == torch.float32 else res.to(q.dtype)


class DecodeCall:
    """``paged_decode_attention`` for every layer of one decode step: the step's block
    tables and lengths are checked once here, and each layer's call is then the kernel
    alone (the per-call checks cost more than the kernel at one short sequence). The
    kernel still checks every table entry it reads against the cache it is given.

    The step's check is the metadata ``_checks.check_block_tables`` reads, compared in
    line: the runner's tables pass it every step, so its named errors are only built
    (by that function) for arguments that fail."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> None:
        if not (isinstance(block_tables, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
                and block_tables.dtype == seq_lens.dtype == torch.int32
                and block_tables.dim() == 2 and seq_lens.dim() == 1
                and block_tables.shape[1] >= 1 and seq_lens.shape[0] == block_tables.shape[0]
                and (block_tables.stride(-1) == 1 or block_tables.shape[1] == 1)
                and (seq_lens.stride(-1) == 1 or seq_lens.shape[0] <= 1)):
            chk.check_block_tables(block_tables, seq_lens, len(block_tables))  # names it
        if block_tables.device.type != "cpu" or seq_lens.device.type != "cpu":
            raise ValueError("the CPU kernel needs CPU block tables and lengths")
        self.tables, self.lens = block_tables, seq_lens.contiguous()
        self.args = (block_tables.data_ptr(), block_tables.shape[1], block_tables.stride(0),
                     self.lens.data_ptr())
        self.scale = float(scale)
        self.fn = _kernel()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float | None = None, window: int = 0,
                 soft_cap: float = 0.0) -> torch.Tensor:
        """q [S, Hq, D] float32 contiguous; caches as ``paged_decode_attention``'s.
        ``scale`` (default: the call's), ``window`` and ``soft_cap``: one layer's, as the
        kernel takes them (0 is off: ``_checks.window_arg``, ``_checks.soft_cap_arg``)."""
        scale = self.scale if scale is None else float(scale)
        num_seqs, num_q_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
        if (q.dtype != torch.float32 or kv_dim != head_dim or k_cache.shape != v_cache.shape
                or not q.is_contiguous() or num_seqs != self.lens.shape[0]
                or k_cache.dtype not in CACHE_DTYPES or k_cache.dtype != v_cache.dtype
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return paged_decode_attention(q, k_cache, v_cache, self.tables, self.lens, scale,
                                          sliding_window=window or None,
                                          logits_soft_cap=soft_cap or None)
        res = torch.empty_like(q)
        rc = self.fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
                     self.args[0], self.args[1], self.args[2], self.args[3], res.data_ptr(),
                     num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale,
                     window, soft_cap, _CACHE_CODE[k_cache.dtype], None, 0)
        if rc != 0:
            raise ValueError(f"paged_decode_attention (cpu): {_ERRORS.get(rc, f'error {rc}')}")
        return res
