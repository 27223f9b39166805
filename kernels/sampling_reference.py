"""The sampling pass in plain torch, and the counter-based noise it draws with: the CPU
path, the oracle of ``kernels.sampling``, and the host half of every row's noise key.

One call turns a step's logits into tokens, row by row with the row's own parameters:
logit bias, then greedy rows take the argmax, sampled rows divide by their temperature,
drop what min-p, top-k and top-p exclude (in that order; top-p's mass is renormalised
over what min-p and top-k kept, as vLLM) and draw with the exponential race
``argmax(p / E)``, ``E`` the counter-based noise of the row's key (below).

Each filter is a threshold on the row's scaled logits: a token is kept when its value is
at least the row's threshold, so tokens tied *at* a boundary are all kept (vLLM's
threshold top-k does the same). Away from ties this keeps exactly the tokens the
sort-based filter kept before, and draws the same tokens; the Triton kernel finds the
same thresholds without sorting (see ``kernels/sampling.py``).

The noise. Sampling takes ``argmax(p / E)`` with one Exp(1) variable per (row, token), which
equals a categorical draw from ``p``. A seeded request must draw the same ``E`` for its n-th
output token wherever it runs: in any batch, after preemption, and on another worker that
resumes it after a crash. A stateful generator per row does not fit a batched device step
(a generator per row means a launch per row, or drawing on the host and copying
``[rows, vocab]`` floats up: 131 MB a step at 256 rows of a 128k vocabulary). So the noise
is a pure function, counter-based in the manner of Philox: each row has a 64-bit key
(from the request's seed and output index, on the host), and the variable for token ``v``
is the SplitMix64 finalizer of ``key + v * GAMMA``. That is a dozen elementwise int64 ops
over ``[rows, vocab]`` on the device, with wrapping multiplication (two's complement gives
the unsigned product's bits) and logical shifts written as shift-and-mask, so the bits are
the same on any device; the top 23 bits make a float32 uniform in (0, 1) exactly. The
Triton kernel computes the same bits from the same constants. Unseeded rows get a fresh
key per step from the sampler's own seeded host generator, so every sampling row takes
this one path.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio)
_TOKEN_STRIDE = 0xD1B54A32D192ED03  # another odd constant: keys of neighbouring rows do not
# walk into each other's token sequences
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(value: int) -> int:
    """SplitMix64's finalizer on a Python int (the host half, and the reference)."""
    value &= _M64
    value = ((value ^ (value >> 30)) * _MUL1) & _M64
    value = ((value ^ (value >> 27)) * _MUL2) & _M64
    return value ^ (value >> 31)


def row_key(seed: int, output_index: int) -> int:
    """The key of a request's ``output_index``-th token (int64 bits)."""
    return key_at(mix64(seed), output_index)


def key_at(seed_mix: int, output_index: int) -> int:
    """``row_key`` from ``mix64(seed)``, which a request computes once."""
    return _signed(mix64(seed_mix + output_index * _GAMMA))


def keys_at(seed_mixes: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """``key_at`` over arrays ([N] uint64 seed mixes, [N] output indices -> [N] int64):
    the same bits, in wrapping uint64 arithmetic, for a whole step's seeded rows at once
    (256 Python ``key_at`` calls cost ~0.5 ms of host time a step)."""
    x = seed_mixes.astype(np.uint64) + output_indices.astype(np.uint64) * np.uint64(_GAMMA)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MUL1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MUL2)
    return (x ^ (x >> np.uint64(31))).view(np.int64)  # type: ignore[no-any-return]


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """``mix64`` on an int64 tensor, in place: the same bits as the Python version."""
    x ^= _srl(x, 30)
    x *= _signed(_MUL1)
    x ^= _srl(x, 27)
    x *= _signed(_MUL2)
    x ^= _srl(x, 31)
    return x


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 -> [R, vocab] float32 uniforms in (0, 1), one per (row, token)."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys.device) * _signed(_TOKEN_STRIDE)
    bits = _mix64_(keys.unsqueeze(1) + tokens)  # [R, V]
    return (_srl(bits, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # exact in fp32


def exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 -> [R, vocab] Exp(1) variables (``-log U``), never zero."""
    return uniform(keys, vocab).log_().neg_()


def random_key(rng: random.Random) -> int:
    """A fresh key for an unseeded row (int64 bits)."""
    return _signed(rng.getrandbits(64))


@dataclass(frozen=True)
class SamplingTensors:
    """A step's per-row sampling parameters: on the logits' device, and their host copy
    (the CPU path decides from it which rows to touch, without reading the device).

    ``params[:, 0]`` temperature (0: greedy), ``[:, 1]`` top-p (1: off), ``[:, 2]`` min-p
    (0: off), ``[:, 3]`` top-k as a float (>= vocab: off; exact below 2**24). The logit
    bias, when a row has one, is a list of ``(row, token, value)`` entries sorted by row,
    with ``bias_offsets[r]:bias_offsets[r + 1]`` the entries of row r."""

    params: torch.Tensor  # [R, 4] float32
    keys: torch.Tensor  # [R] int64, the noise keys (any value in greedy rows)
    # params, on the host: [R] rows of 4 (a float32 array, or the rows' own values)
    host: Sequence[Sequence[float]] | np.ndarray
    bias_offsets: torch.Tensor | None = None  # [R + 1] int32
    bias_entries: torch.Tensor | None = None  # [2, N] int32: rows, tokens
    bias_values: torch.Tensor | None = None  # [N] float32


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without a host sync (a pinned, non-blocking copy on a GPU;
    ``worker.engine.runner.transfer``'s rule, which ``kernels`` may not import)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def biased(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """[R, V] float32 logits plus each row's bias (a copy only when there is one)."""
    logits = logits.float()
    if t.bias_entries is None or t.bias_values is None:
        return logits
    rows, tokens = t.bias_entries.long().unbind(0)
    return logits.index_put((rows, tokens), t.bias_values, accumulate=True)


def kept(scaled: torch.Tensor, host: Sequence[Sequence[float]]) -> torch.Tensor:
    """scaled [S, V] -> the same with -inf where min-p, top-k and top-p drop (in that
    order); ``host``: the S rows' (temperature, top-p, min-p, top-k).

    Each is a threshold on the row's values; top-p's is the smallest sorted value whose
    better tokens hold less than ``top_p`` of the mass min-p and top-k left. As the old
    sort-based filter: only rows that filter are touched, and only the largest k are
    sorted when every such row has a top-k."""
    vocab, device = scaled.shape[1], scaled.device
    if any(row[2] > 0 for row in host):
        min_p = to_device([row[2] for row in host], torch.float32, device)
        probs = torch.softmax(scaled, dim=-1)
        dropped = probs < probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        scaled = scaled.masked_fill(dropped, float("-inf"))
    filtering = [i for i, row in enumerate(host) if row[3] < vocab or row[1] < 1.0]
    if not filtering:
        return scaled
    width = int(max(min(host[i][3], vocab) for i in filtering))
    index = to_device(filtering, torch.long, device)
    sub = scaled.index_select(0, index)  # [F, V]
    top = sub.topk(width, dim=-1).values if width < vocab \
        else sub.sort(dim=-1, descending=True).values  # [F, W]
    k = to_device([min(int(host[i][3]), width) - 1 for i in filtering], torch.long, device)
    k_value = top.gather(1, k.unsqueeze(1))  # [F, 1]
    top = top.masked_fill(top < k_value, float("-inf"))  # top-k, ties kept
    mass = torch.softmax(top, dim=-1)
    before = mass.cumsum(dim=-1) - mass  # mass of the better tokens
    top_p = to_device([host[i][1] for i in filtering], torch.float32, device).unsqueeze(1)
    last = torch.where(top_p >= 1.0, width, (before < top_p).sum(dim=-1, keepdim=True))
    threshold = top.gather(1, last.clamp(1, width) - 1)  # the top token always survives
    sub = sub.masked_fill((sub < threshold) | (sub < k_value), float("-inf"))
    return scaled.index_copy(0, index, sub)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> tokens [R] int64, without reading the device.

    A row whose logits are all -inf gets token 0, as the argmax of the old path did."""
    x = biased(logits, t)  # [R, V]
    tokens = x.argmax(dim=-1)  # greedy rows' answer
    host = t.host.tolist() if isinstance(t.host, np.ndarray) else t.host
    sampled = [i for i, row in enumerate(host) if row[0] > 0]
    if not sampled:
        return tokens
    index = to_device(sampled, torch.long, x.device)
    rows = x if len(sampled) == x.shape[0] else x.index_select(0, index)
    temperature = t.params.index_select(0, index)[:, :1]  # [S, 1]
    scaled = kept(rows / temperature, [host[i] for i in sampled])  # [S, V]
    probs = torch.softmax(scaled, dim=-1)
    drawn = (probs / exponential(t.keys.index_select(0, index), x.shape[1])).argmax(dim=-1)
    return tokens.index_copy(0, index, drawn)
