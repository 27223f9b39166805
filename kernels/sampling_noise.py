"""Exp(1) noise for the exponential race, drawn on the device as a function of a key.

Sampling takes ``argmax(p / E)`` with one Exp(1) variable per (row, token), which equals a
categorical draw from ``p``. A seeded request must draw the same ``E`` for its n-th output
token wherever it runs: in any batch, after preemption, and on another worker that resumes
it after a crash. A stateful generator per row does not fit a batched device step (a
generator per row means a launch per row, or drawing on the host and copying
``[rows, vocab]`` floats up: 131 MB a step at 256 rows of a 128k vocabulary). So the noise
is a pure function, counter-based in the manner of Philox: each row has a 64-bit key
(from the request's seed and output index, on the host), and the variable for token ``v``
is the SplitMix64 finalizer of ``key + v * GAMMA``. That is a dozen elementwise int64 ops
over ``[rows, vocab]`` on the device, with wrapping multiplication (two's complement gives
the unsigned product's bits) and logical shifts written as shift-and-mask, so the bits are
the same on any device; the top 23 bits make a float32 uniform in (0, 1) exactly.

Unseeded rows get a fresh key per step from the sampler's own seeded host generator, so
every sampling row takes this one path.
"""

from __future__ import annotations

import random

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
