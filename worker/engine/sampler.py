"""Batched token sampling with per-request parameters, on the logits' device.

Sampling uses the exponential race (``argmax(p / E)``, E ~ Exp(1)), which equals a
categorical draw and needs one noise value per (row, token). The noise is a pure function
of a key (``kernels/sampling_noise.py``): a seeded request's key comes from ``(seed,
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernels.sampling_noise import key_at, keys_at, mix64, random_key
from kernels.sampling_reference import SamplingTensors
from kernels.sampling_reference import sample as sample_reference
from protocol.sampling import SamplingParams
from worker.engine.logits_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
    wants_penalties,
)
from worker.engine.transfer import ReadBack, host_to_device, to_device

if TYPE_CHECKING:
    from worker.engine.request import Request

_NO_TOP_K = 1 << 24  # top-k off: at least any vocabulary (exact in float32)
_SEED_MIX = "seed_mix"  # SamplingRow.cache: mix64 of the request's seed (its keys' base)
_PARAMS = "sampling_params"  # SamplingRow.cache: the row of ``SamplingTensors.host``
Logprobs = tuple[float, list[tuple[int, float]]]  # (sampled token's, [(token, logprob)] top-n)


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    output_index: int  # index of the token being sampled within the request's output
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # known output tokens; only penalties read them
    # Per request, kept across its steps: device tensors built once (the prompt's mask)
    cache: dict[str, Any] = field(default_factory=dict)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # banned token sequences
    # [1] int64 on the device: the output token of the step still in flight (a
    # placeholder on the host), which penalties count there without a host sync.
    pending_output: torch.Tensor | None = None
    # from the params (``Request`` answers them once): any penalty; greedy with no bias
    penalised: bool | None = None
    plain_greedy: bool | None = None
    # answered once from the params (plain attributes: a pydantic property read costs
    # ~0.3 us, and a step asks each of 256 rows several questions)
    greedy: bool = field(init=False)
    masked: bool = field(init=False)  # allowed_token_ids or bad words
    wants_logprobs: bool = field(init=False)
    seed_mix: int | None = field(init=False)  # mix64(seed) of a seeded sampled row
    params_row: tuple[float, float, float, float] = field(init=False)  # SamplingTensors.host
    params_bytes: bytes = field(init=False)  # params_row as 4 float32s
    has_bias: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        if self.penalised is None:
            self.penalised = wants_penalties(params)
        if self.plain_greedy is None:
            self.plain_greedy = params.greedy and not params.logit_bias
        self.greedy = params.greedy
        self.masked = params.allowed_token_ids is not None or bool(self.bad_words_ids)
        self.wants_logprobs = params.logprobs is not None
        self.seed_mix = None if self.greedy or params.seed is None else _seed_mix(self)
        self.params_row = self.cache.get(_PARAMS) or _params_row(self)
        self.params_bytes = np.array(self.params_row, dtype=np.float32).tobytes()
        self.has_bias = bool(params.logit_bias)

    @classmethod
    def of(cls, request: Request,
           in_flight: tuple[torch.Tensor, dict[str, int]] | None = None) -> SamplingRow:
        """The row of a request about to sample: its output index counts the tokens of
        steps still in flight; its output tokens are copied only for penalties and
        multi-token bad words. ``in_flight``: the sampled tokens of the step in flight
        (on the device) and each request's row in them (``inflight.py``).

        One row object per request, made at its first step and brought up to date at each
        later one (building 256 rows a step cost ~0.3 ms): a step's rows are read while it
        is launched and, for their params alone, when its logprobs are unpacked."""
        row: SamplingRow | None = request.sampling_row
        if row is None:
            row = request.sampling_row = cls(
                request.params, 0, request.prompt_token_ids, (), request.sampler_cache,
                request.bad_words_ids, None, request.penalised, request.plain_greedy)
        row.output_index = len(request.output_token_ids)
        if row.penalised or request.bans_follow_output:
            row.output_token_ids = request.known_output_ids
            row.pending_output = None
            if row.penalised and request.num_pending:
                i = -1 if in_flight is None else in_flight[1].get(request.request_id, -1)
                if i < 0 or request.num_pending > 1:
                    raise RuntimeError(f"{request.request_id}: a pending token with no "
                                       "step in flight to read it from")
                row.pending_output = in_flight[0][i:i + 1]  # type: ignore[index]  # a view
        return row

    def refresh(self, request: Request) -> None:
        """The step before was read back since the row was made: its token is known."""
        if self.penalised or request.bans_follow_output:
            self.output_token_ids = request.known_output_ids
            self.pending_output = None


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
    ) -> PendingSample:
        """logits: [num_rows, vocab] (any float dtype, any device).

        ``grammar_mask``: (constrained row indices, their int32 bitmask), see
        ``apply_token_bitmask``; reported logprobs are the model's, before the masks
        (the grammar's, ``allowed_token_ids``, ``bad_words``).
        """
        if any(r.penalised for r in rows):
            logits = apply_penalties(logits.float(), rows)
        asked = [i for i, r in enumerate(rows) if r.wants_logprobs]
        model_logprobs = None
        if asked:  # the model's logprobs: after penalties and bias, before the masks
            biased = apply_logit_bias(_rows_of(logits, asked).float(), [rows[i] for i in asked])
            model_logprobs = torch.log_softmax(biased, dim=-1)
        if any(r.masked for r in rows):
            logits = apply_bad_words(apply_allowed_token_ids(logits, rows), rows)
        if grammar_mask is not None:  # [structured output]
            logits = apply_token_bitmask(logits, *grammar_mask)
        if all(r.plain_greedy for r in rows):
            tokens = _greedy_pass(logits)  # [B]: nothing else to do, no parameters to send
        else:
            tensors = sampling_tensors(rows, self.keys(rows), logits.device)
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

    def _key(self, row: SamplingRow) -> int:
        """The row's noise key: from its seed and output index, else fresh (sampled rows
        only, in row order: the host generator advances as it always has)."""
        if row.greedy:
            return 0
        if row.seed_mix is None:
            return random_key(self._rng)
        return key_at(row.seed_mix, row.output_index)


def _seed_mix(row: SamplingRow) -> int:
    """``mix64`` of the row's seed, kept in its request's cache."""
    seed_mix = row.cache.get(_SEED_MIX)
    if seed_mix is None:
        assert row.params.seed is not None
        seed_mix = row.cache[_SEED_MIX] = mix64(row.params.seed)
    return seed_mix  # type: ignore[no-any-return]


def sampling_tensors(rows: list[SamplingRow], keys: list[int] | np.ndarray,
                     device: torch.device) -> SamplingTensors:
    """The rows' parameters as the sampling pass reads them: two copies up, three more
    when a row has a logit bias. Greedy rows (temperature 0 or top-k 1) get temperature 0;
    top-k off is any value >= the vocabulary (2**24 here)."""
    host = tuple(r.params_row for r in rows)
    # [B, 4] float32 from each row's bytes: ~10x faster than np.array over the tuples
    flat = np.frombuffer(b"".join([r.params_bytes for r in rows]), dtype=np.float32)
    params = host_to_device(torch.from_numpy(flat.reshape(-1, 4).copy()), device)
    keys_up = host_to_device(torch.from_numpy(np.asarray(keys, dtype=np.int64)), device)
    if not any(r.has_bias for r in rows):
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


def _params_row(row: SamplingRow) -> tuple[float, float, float, float]:
    """A row's (temperature, top-p, min-p, top-k) as the sampling pass reads them, kept in
    its request's cache (the params never change)."""
    p = row.params
    row.cache[_PARAMS] = value = (0.0 if p.greedy else p.temperature, p.top_p, p.min_p,
                                  float(p.top_k if p.top_k > 0 else _NO_TOP_K))
    return value


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
