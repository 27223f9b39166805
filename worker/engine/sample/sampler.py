"""Batched token sampling with per-request parameters, on the logits' device.

Sampling uses the exponential race (``argmax(p / E)``, E ~ Exp(1)), which equals a
categorical draw and needs one noise value per (row, token). The noise is a pure function
of a key (``kernels/sampling_reference.py``): a seeded request's key comes from ``(seed,
output index)``, so its tokens do not depend on the batch around it, on preemption, or on
which worker resumes it after a crash; an unseeded row gets a fresh key from the
sampler's own generator.

Penalties and the token masks (``allowed_token_ids``, bad words, a grammar's) change the
logits first, only in the rows that have them; then one sampling pass does the rest for
every row: logit bias, greedy argmax, temperature, min-p, top-k, top-p and the race. On a
GPU that pass is one Triton kernel that reads each row a few times and writes one token
(``kernels/sampling.py``: no sort, no ``[rows, vocab]`` temporaries); elsewhere it is the
kernel's torch twin (``kernels/sampling_reference.py``). Both draw the tokens the
sort-based filters drew, ties at a filter's boundary aside (kept whole now).

Nothing here waits for the device, and the host's work does not grow with the vocabulary:
parameters go up in one pinned copy per tensor, decisions are made from the host-side
parameters, and ``launch`` returns the tokens still on the device (the next step's inputs
read them there) with their copy to the host, and the logprobs', under way.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from kernels.sampling_reference import SamplingTensors, key_at, keys_at, random_key
from kernels.sampling_reference import sample as sample_reference
from worker.engine.runner.transfer import ReadBack, host_to_device, to_device
from worker.engine.sample.logits_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
)
from worker.engine.sample.rows import (
    BIAS,
    LOGPROBS,
    MASKED,
    NOT_PLAIN_GREEDY,
    PENALISED,
    SAMPLED,
    SEEDED,
    RowConstants,
    RowFacts,
    SamplingRow,
)

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "SamplingRow", "sampling_tensors"]

Logprobs = tuple[float, list[tuple[int, float]]]  # (sampled token's, [(token, logprob)] top-n)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked for: (sampled token logprob, [(token id, logprob), ...top-n]).
    logprobs: list[Logprobs | None]


class PendingSample:
    """One step's sampled tokens: on the device now, on the host after ``result()``."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor | None,
                 rows: list[SamplingRow]) -> None:
        self.tokens = tokens  # [num_rows] int64, on the logits' device
        self._host = ReadBack(tokens)
        self._logprobs = None if logprobs is None else ReadBack(logprobs)
        self._rows = rows

    def result(self) -> SamplerOutput:
        """Wait for the copies (and so for the step); unpack the asked-for logprobs."""
        token_list: list[int] = self._host.wait().tolist()
        if self._logprobs is None:
            return SamplerOutput(token_list, [None] * len(self._rows))
        return SamplerOutput(token_list, _unpack_logprobs(self._logprobs.wait(), self._rows))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)  # keys of unseeded rows
        # the fused Triton pass on CUDA; False after it failed to build at start
        # (warmup.warm_up_sampling): its torch twin draws the same tokens
        self.fused = True

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow],
        grammar_mask: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample and wait for the tokens: ``launch(...).result()``."""
        return self.launch(logits, rows, grammar_mask).result()

    def launch(
        self, logits: torch.Tensor, rows: list[SamplingRow],
        grammar_mask: tuple[list[int], torch.Tensor] | None = None,
        constants: RowConstants | None = None,
    ) -> PendingSample:
        """logits: [num_rows, vocab] (any float dtype, any device).

        ``grammar_mask``: (constrained row indices, their int32 bitmask), see
        ``apply_token_bitmask``; reported logprobs are the model's, before the masks
        (the grammar's, ``allowed_token_ids``, ``bad_words``). ``constants``: the rows'
        constants as arrays (``sample/rows.py``), read in place of the row objects'
        attributes when given (the same values, so the same tokens).
        """
        facts = RowFacts(rows) if constants is None else constants
        if facts.any(PENALISED):
            logits = apply_penalties(logits.float(), rows)
        asked = facts.rows_with(LOGPROBS)
        model_logprobs = None
        if asked:  # the model's logprobs: after penalties and bias, before the masks
            biased = apply_logit_bias(_rows_of(logits, asked).float(), [rows[i] for i in asked])
            model_logprobs = torch.log_softmax(biased, dim=-1)
        if facts.any(MASKED):
            logits = apply_bad_words(apply_allowed_token_ids(logits, rows), rows)
        if grammar_mask is not None:  # [structured output]
            logits = apply_token_bitmask(logits, *grammar_mask)
        if not facts.any(NOT_PLAIN_GREEDY):
            tokens = _greedy_pass(logits)  # [B]: nothing else to do, no parameters to send
        else:
            keys = self.keys(rows) if constants is None else self.constant_keys(constants)
            tensors = sampling_tensors(rows, keys, logits.device, constants)
            # [B] int64; bias, filters, race inside
            tokens = _sample_pass(logits, tensors, self.fused)
        packed = None
        if model_logprobs is not None:
            packed = _pack_logprobs(model_logprobs, _rows_of(tokens, asked),
                                    max(rows[i].params.logprobs or 0 for i in asked))
        return PendingSample(tokens, packed, rows)

    def keys(self, rows: list[SamplingRow]) -> np.ndarray:
        """[B] int64: each row's ``_key``, the seeded ones computed together (``keys_at``);
        unseeded rows draw from the host generator in row order, as ``_key`` would."""
        n = len(rows)
        if all(r.seed_mix is not None for r in rows):  # a seeded batch: no per-row branch
            return keys_at(np.fromiter((r.seed_mix for r in rows), np.uint64, n),
                           np.fromiter((r.output_index for r in rows), np.uint64, n))
        keys = np.zeros(n, dtype=np.int64)
        seeded: list[int] = []
        for i, row in enumerate(rows):
            if row.seed_mix is not None:
                seeded.append(i)
            elif not row.greedy:
                keys[i] = random_key(self._rng)
        if seeded:
            mixes = np.fromiter((rows[i].seed_mix for i in seeded), np.uint64, len(seeded))
            indices = np.fromiter((rows[i].output_index for i in seeded), np.uint64,
                                  len(seeded))
            keys[seeded] = keys_at(mixes, indices)
        return keys

    def constant_keys(self, constants: RowConstants) -> np.ndarray:
        """``keys`` from the rows' columns: the same keys, the host generator drawn for the
        same rows in the same order."""
        seeded = constants.flags & SEEDED
        if seeded.all():
            return keys_at(constants.seed_mix, constants.output_index)
        keys = np.zeros(len(seeded), dtype=np.int64)
        for i in constants.rows_with(SAMPLED):
            if not seeded[i]:
                keys[i] = random_key(self._rng)
        where = seeded.nonzero()[0]
        if len(where):
            keys[where] = keys_at(constants.seed_mix[where], constants.output_index[where])
        return keys

    def _key(self, row: SamplingRow) -> int:
        """The row's noise key: from its seed and output index, else fresh (sampled rows
        only, in row order: the host generator advances as it always has)."""
        if row.greedy:
            return 0
        if row.seed_mix is None:
            return random_key(self._rng)
        return key_at(row.seed_mix, row.output_index)


def sampling_tensors(rows: list[SamplingRow], keys: list[int] | np.ndarray,
                     device: torch.device, constants: RowConstants | None = None,
                     ) -> SamplingTensors:
    """The rows' parameters as the sampling pass reads them: two copies up, three more
    when a row has a logit bias. Greedy rows (temperature 0 or top-k 1) get temperature 0;
    top-k off is any value >= the vocabulary (2**24 here). ``constants``: the same parameters
    as arrays (``sample/rows.py``)."""
    host: Sequence[Sequence[float]] | np.ndarray
    if constants is None:  # [B, 4] float32 from each row's bytes (~10x faster than np.array)
        host = tuple(map(_PARAMS_ROW, rows))
        flat = np.frombuffer(b"".join([r.params_bytes for r in rows]), dtype=np.float32)
        host_params = flat.reshape(-1, 4).copy()
    else:  # a fresh array (gathered for this step), the host copy too: the torch pass
        # decides (> 0, < 1, top-k) from its float32 values as from the rows' own; the
        # fused kernel reads none of it
        host = host_params = constants.params
    params = host_to_device(torch.from_numpy(host_params), device)
    keys_up = host_to_device(torch.from_numpy(np.asarray(keys, dtype=np.int64)), device)
    if not (any(r.has_bias for r in rows) if constants is None else constants.any(BIAS)):
        return SamplingTensors(params, keys_up, host)
    offsets: list[int] = [0]
    entries: list[list[int]] = [[], []]
    values: list[float] = []
    for i, r in enumerate(rows):
        for token, bias in (r.params.logit_bias or {}).items():
            entries[0].append(i)
            entries[1].append(token)
            values.append(bias)
        offsets.append(len(values))
    return SamplingTensors(params, keys_up, host, to_device(offsets, torch.int32, device),
                           to_device(entries, torch.int32, device),
                           to_device(values, torch.float32, device))


_PARAMS_ROW = attrgetter("params_row")


def _greedy_pass(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: the argmax (one launch on a GPU)."""
    return logits.argmax(dim=-1)


def _sample_pass(logits: torch.Tensor, tensors: SamplingTensors,
                 fused: bool = True) -> torch.Tensor:
    """The fused Triton pass on a GPU, its torch twin elsewhere (same tokens)."""
    if logits.is_cuda and fused:
        from kernels.sampling import sample  # imports triton: only where it runs

        return sample(logits, tensors)
    return sample_reference(logits, tensors)


def _rows_of(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """values[rows] (all of it when ``rows`` is every row, in order)."""
    if len(rows) == values.shape[0]:
        return values
    return values.index_select(0, to_device(rows, torch.long, values.device))


def _pack_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """[W, V] log-softmax and the W sampled tokens -> [W, 1 + 2 * top] float64: the
    sampled token's logprob, the top logprobs, their token ids (exact in float64). One
    tensor, so one copy back for the whole batch."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [W, 1]
    values, ids = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)  # [W, top], sorted
    return torch.cat([chosen.double(), values.double(), ids.double()], dim=1)


def _unpack_logprobs(packed: torch.Tensor, rows: list[SamplingRow]) -> list[Logprobs | None]:
    table = packed.tolist()  # host memory already: one conversion for the batch
    result: list[Logprobs | None] = []
    it = iter(table)
    for row in rows:
        n = row.params.logprobs
        if n is None:
            result.append(None)
            continue
        line = next(it)
        top = (len(line) - 1) // 2
        pairs = [(int(line[1 + top + j]), line[1 + j]) for j in range(n)]
        result.append((line[0], pairs))
    return result
