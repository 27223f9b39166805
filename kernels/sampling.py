"""One sampling pass per step: logits -> tokens in a single Triton launch, without a sort.

One program per row walks the row's logits in ``BLOCK``-wide chunks; nothing of size
``[rows, vocab]`` is ever written. What it computes is ``kernels.sampling_reference``'s
``sample``: logit bias (a CSR list added to each chunk as it is loaded), greedy argmax,
temperature, min-p, top-k, top-p (ties at a boundary kept) and the exponential race
``argmax(p / E)`` with the counter-based noise of ``kernels.sampling_reference``,
recomputed in registers from the row's key (the same bits as the torch version).

Passes over a sampled row:

1. max and argmax (a greedy row stops here: its token is the argmax);
2. a histogram of the kept-so-far tokens over ``NB`` value buckets spanning
   ``[max - SPAN, max]`` (lower values share the last bucket): per bucket the count, the
   softmax mass ``exp(s - max)``, the smallest and largest value, and the best race score
   ``exp(s - max) / E`` with its token. Buckets are contiguous value ranges, ordered from
   the top.

Top-k first (when on): the bucket where the count reaches ``k`` holds the threshold; if
it holds one value, that value is it; else the next pass histograms that bucket only
(its own min..max) until it does. Top-p then walks the buckets by mass: every bucket
before the one where the kept mass reaches ``top_p`` is kept, every bucket after it is
dropped, so the race's winner so far is the best of the kept buckets. The boundary
bucket matters only if its own best race score beats that winner (about as likely as
its share of the mass): only then does another pass refine it. A temperature/top-p row
thus costs two reads of its logits plus an occasional third.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling_reference import _MUL1, _MUL2, _TOKEN_STRIDE, SamplingTensors, _signed

BLOCK = 512  # logits per chunk
NB = 32  # value buckets per histogram
SPAN = 16.0  # the first histogram's value range below the row's max
MAX_LEVELS = 40  # refinements of one boundary (each strictly narrows it; a guard only)
NUM_WARPS = 8  # sm_90: 148 registers a thread, no spills (4 warps spill)

_STRIDE = tl.constexpr(_signed(_TOKEN_STRIDE))
_M1 = tl.constexpr(_signed(_MUL1))
_M2 = tl.constexpr(_signed(_MUL2))


@triton.jit
def _srl(x, shift: tl.constexpr):
    """Logical right shift of int64 bits."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


@triton.jit
def _noise(key, offs):
    """Exp(1) variables of tokens ``offs`` [BLOCK] under ``key``: sampling_reference's bits."""
    x = key + offs.to(tl.int64) * _STRIDE
    x ^= _srl(x, 30)
    x *= _M1
    x ^= _srl(x, 27)
    x *= _M2
    x ^= _srl(x, 31)
    u = (_srl(x, 41).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
    return -tl.log(u)


@triton.jit
def _load(row_ptr, offs, vocab, bias_tok, bias_val, b_lo, b_hi):
    """One chunk of a row's logits as float32 with its bias added; -inf past the row.
    (``b_lo == b_hi`` when the row has no bias: the loop does not run.)"""
    x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    for j in range(b_lo, b_hi):
        x = tl.where(offs == tl.load(bias_tok + j), x + tl.load(bias_val + j), x)
    return x


@triton.jit
def _histogram(row_ptr, vocab, bias_tok, bias_val, b_lo, b_hi, temp, top, cut, key,
               inc_lo, inc_hi, grid_lo, BLOCK: tl.constexpr, NB: tl.constexpr):
    """One read of the row: per bucket of ``[grid_lo, inc_hi]`` (bucket 0 at the top;
    lower values in the last), the count, mass, min, max and best race score (and its
    token) of the tokens with ``inc_lo <= s <= inc_hi`` that min-p keeps (``e >= cut``)."""
    bins = tl.arange(0, NB)
    count = tl.zeros([NB], tl.float32)
    mass = tl.zeros([NB], tl.float32)
    low = tl.full([NB], float("inf"), tl.float32)
    high = tl.full([NB], float("-inf"), tl.float32)
    best = tl.full([NB], -1.0, tl.float32)
    best_i = tl.zeros([NB], tl.int32)
    width = (inc_hi - grid_lo) / NB
    step = tl.where(width > 0, width, 1.0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        s = _load(row_ptr, offs, vocab, bias_tok, bias_val, b_lo, b_hi) / temp
        e = tl.exp(s - top)
        ok = (s >= inc_lo) & (s <= inc_hi) & (s > float("-inf")) & (e >= cut)
        b = tl.where(width > 0, tl.floor((inc_hi - s) / step), 0.0)
        b = tl.where(ok, tl.minimum(tl.maximum(b, 0.0), NB - 1.0), -1.0).to(tl.int32)
        hit = b[:, None] == bins[None, :]  # [BLOCK, NB]
        s2 = s[:, None]  # [BLOCK, 1]
        q = tl.where(ok, e / _noise(key, offs), -1.0)  # the race's score, p / E up to 1/Z
        q2 = q[:, None]
        count += tl.sum(hit.to(tl.float32), axis=0)
        mass += tl.sum(tl.where(hit, e[:, None], 0.0), axis=0)
        low = tl.minimum(low, tl.min(tl.where(hit, s2, float("inf")), axis=0))
        high = tl.maximum(high, tl.max(tl.where(hit, s2, float("-inf")), axis=0))
        cand = tl.max(tl.where(hit, q2, -1.0), axis=0)  # [NB]
        first = tl.where(hit & (q2 == cand[None, :]), offs[:, None], 2147483647)
        better = cand > best  # earlier chunks win ties: lower token ids
        best_i = tl.where(better, tl.min(first, axis=0), best_i)
        best = tl.where(better, cand, best)
    return count, mass, low, high, best, best_i


@triton.jit
def _pick(values, bins, b):
    """values[b] as a scalar (0 when b is past the end)."""
    return tl.sum(tl.where(bins == b, values, 0), axis=0)


@triton.jit
def _top_k_value(row_ptr, vocab, bias_tok, bias_val, b_lo, b_hi, temp, top, cut, key, top_k,
                 BLOCK: tl.constexpr, NB: tl.constexpr, SPAN: tl.constexpr,
                 MAX_LEVELS: tl.constexpr):
    """The k-th largest kept value (-inf when fewer than k are kept) and the passes."""
    bins = tl.arange(0, NB)
    kth = tl.full([], float("-inf"), tl.float32)
    lo = tl.full([], float("-inf"), tl.float32)
    hi = top
    grid_lo = top - SPAN
    above = tl.zeros([], tl.float32)
    passes = tl.zeros([], tl.int32)
    while (passes < MAX_LEVELS) & (passes >= 0):
        count, mass, low, high, best, best_i = _histogram(
            row_ptr, vocab, bias_tok, bias_val, b_lo, b_hi, temp, top, cut, key,
            lo, hi, grid_lo, BLOCK, NB)
        reach = above + tl.cumsum(count, 0)  # [NB] kept count through each bucket
        b = tl.min(tl.where(reach >= top_k, bins, NB), axis=0)
        b_low = _pick(low, bins, b)
        b_high = _pick(high, bins, b)
        b_reach = _pick(reach, bins, b)
        found = b < NB
        settled = (~found) | (b_low == b_high) | (b_reach == top_k)
        kth = tl.where(found, b_low, float("-inf"))
        above = b_reach - _pick(count, bins, b)
        lo = b_low
        hi = b_high
        grid_lo = b_low
        passes = tl.where(settled, -passes - 1, passes + 1)  # negative: done
    return kth, tl.where(passes < 0, -passes, passes)


@triton.jit
def _race(row_ptr, vocab, bias_tok, bias_val, b_lo, b_hi, temp, top, cut, key, top_p, kth,
          fallback, BLOCK: tl.constexpr, NB: tl.constexpr, SPAN: tl.constexpr,
          MAX_LEVELS: tl.constexpr):
    """The race's winner among the tokens >= ``kth`` that min-p and top-p keep, and the
    passes it took (see the module docstring)."""
    bins = tl.arange(0, NB)
    lo = kth
    hi = top
    grid_lo = tl.maximum(kth, top - SPAN)
    above = tl.zeros([], tl.float32)
    target = tl.zeros([], tl.float32)
    win = tl.full([], -1.0, tl.float32)
    win_i = fallback
    passes = tl.zeros([], tl.int32)
    while (passes < MAX_LEVELS) & (passes >= 0):
        count, mass, low, high, best, best_i = _histogram(
            row_ptr, vocab, bias_tok, bias_val, b_lo, b_hi, temp, top, cut, key,
            lo, hi, grid_lo, BLOCK, NB)
        target = tl.where(passes == 0, top_p * tl.sum(mass, axis=0), target)
        reach = above + tl.cumsum(mass, 0)  # [NB] kept mass through each bucket
        b = tl.min(tl.where(reach >= target, bins, NB), axis=0)
        b = tl.where(top_p < 1.0, b, NB)  # top-p off: every bucket kept
        kept = bins < b  # buckets above the boundary: all kept
        cand = tl.max(tl.where(kept, best, -1.0), axis=0)
        cand_i = tl.min(tl.where(kept & (best == cand), best_i, 2147483647), axis=0)
        better = (cand > win) | ((cand == win) & (cand_i < win_i))
        win_i = tl.where(better, cand_i, win_i)
        win = tl.where(better, cand, win)
        b_best = tl.where(b < NB, _pick(best, bins, b), -1.0)
        b_best_i = _pick(best_i, bins, b)
        beats = (b_best > win) | ((b_best == win) & (b_best_i < win_i))
        b_low = _pick(low, bins, b)
        b_high = _pick(high, bins, b)
        single = b_low == b_high  # a tie group: all kept, its top is
        take = beats & single
        win_i = tl.where(take, b_best_i, win_i)
        win = tl.where(take, b_best, win)
        above = _pick(reach, bins, b) - _pick(mass, bins, b)
        lo = b_low
        hi = b_high
        grid_lo = b_low
        settled = (~beats) | single
        passes = tl.where(settled, -passes - 1, passes + 1)
    return win_i, tl.where(passes < 0, -passes, passes)


@triton.jit
def _sample_kernel(
    logits_ptr,  # [R, V] float32/bfloat16/float16
    params_ptr,  # [R, 4] float32: temperature, top-p, min-p, top-k
    keys_ptr,  # [R] int64
    bias_off_ptr,  # [R + 1] int32
    bias_tok_ptr,  # [N] int32
    bias_val_ptr,  # [N] float32
    out_ptr,  # [R] int64 tokens
    passes_ptr,  # [R] int32 reads of the row (a measure, for the traffic count)
    vocab,
    stride_r,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    SPAN: tl.constexpr,
    MAX_LEVELS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    temp = tl.load(params_ptr + row * 4)
    b_lo = tl.zeros([], tl.int32)
    b_hi = tl.zeros([], tl.int32)
    if HAS_BIAS:
        b_lo = tl.load(bias_off_ptr + row)
        b_hi = tl.load(bias_off_ptr + row + 1)
    top = tl.full([], float("-inf"), tl.float32)
    arg = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):  # pass 1: max and argmax
        x = _load(row_ptr, start + tl.arange(0, BLOCK), vocab, bias_tok_ptr, bias_val_ptr,
                  b_lo, b_hi)
        block_max = tl.max(x, axis=0)
        arg = tl.where(block_max > top, tl.argmax(x, axis=0) + start, arg)
        top = tl.maximum(top, block_max)
    token = arg
    passes = tl.full([], 1, tl.int32)
    if (temp > 0) & (top > float("-inf")):
        top_p = tl.load(params_ptr + row * 4 + 1)
        cut = tl.load(params_ptr + row * 4 + 2)
        top_k = tl.load(params_ptr + row * 4 + 3)
        key = tl.load(keys_ptr + row)
        top_s = top / temp
        kth = tl.full([], float("-inf"), tl.float32)
        if top_k < vocab:
            kth, k_passes = _top_k_value(row_ptr, vocab, bias_tok_ptr, bias_val_ptr, b_lo,
                                         b_hi, temp, top_s, cut, key, top_k, BLOCK, NB, SPAN,
                                         MAX_LEVELS)
            passes += k_passes
        token, p_passes = _race(row_ptr, vocab, bias_tok_ptr, bias_val_ptr, b_lo, b_hi, temp,
                                top_s, cut, key, top_p, kth, arg, BLOCK, NB, SPAN, MAX_LEVELS)
        passes += p_passes
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(passes_ptr + row, passes)


def sample(logits: torch.Tensor, t: SamplingTensors,
           passes: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (fp32/bf16/fp16, unit stride on V) -> tokens [R] int64, in one launch.

    ``passes`` (optional [R] int32) receives how many times each row's logits were read."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with unit stride, got {logits.shape}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    rows, vocab = logits.shape
    if t.params.shape != (rows, 4) or t.keys.shape != (rows,):
        raise ValueError(f"sampling tensors for {t.params.shape[0]} rows, logits have {rows}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if passes is None:
        passes = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    has_bias = t.bias_offsets is not None and t.bias_entries is not None
    offsets = t.bias_offsets if has_bias else out  # unread without a bias
    tokens = t.bias_entries[1] if t.bias_entries is not None else out
    values = t.bias_values if t.bias_values is not None else out
    _sample_kernel[(rows,)](logits, t.params, t.keys, offsets, tokens, values, out, passes,
                            vocab, logits.stride(0), BLOCK=BLOCK, NB=NB, SPAN=SPAN,
                            MAX_LEVELS=MAX_LEVELS, HAS_BIAS=has_bias,
                            num_warps=NUM_WARPS)
    return out
