"""Batched token sampling with per-request parameters.

Seeded requests draw their noise from a generator seeded by ``(seed, output index)``, so a
request's tokens do not depend on the batch around it, on preemption, or on which worker
resumes it after a crash. Sampling uses the exponential-race trick
(``argmax(p / E)``, E ~ Exp(1)), which equals a categorical draw and needs one noise
tensor per row.

Nothing here waits for the device: parameters go up through pinned memory, decisions
are made from the host-side parameters, and ``launch`` returns the tokens still on the
device (the next step's inputs read them there) with a copy to the host under way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.sampling import SamplingParams
from worker.engine.transfer import ReadBack, host_to_device, to_device

if TYPE_CHECKING:
    from worker.engine.request import Request

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over generator seeds


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    output_index: int  # index of the token being sampled within the request's output
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @classmethod
    def of(cls, request: Request) -> SamplingRow:
        """The row of a request about to sample: its output index counts the tokens of
        steps still in flight; penalties read only the known tokens."""
        return cls(request.params, request.num_output_tokens, request.prompt_token_ids,
                   request.known_output_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked for: (sampled token logprob, [(token id, logprob), ...top-n]).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class PendingSample:
    """One step's sampled tokens: on the device now, on the host after ``result()``."""

    def __init__(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None,
                 rows: list[SamplingRow]) -> None:
        self.tokens = tokens  # [num_rows] int64, on the logits' device
        self._host = ReadBack(tokens)
        self._raw_logprobs = raw_logprobs
        self._rows = rows

    def result(self) -> SamplerOutput:
        """Wait for the copy (and so for the step) and gather the asked-for logprobs."""
        token_list: list[int] = self._host.wait().tolist()
        return SamplerOutput(token_list,
                             _gather_logprobs(self._raw_logprobs, token_list, self._rows))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

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
        ``apply_token_bitmask``; reported logprobs are the model's, before the mask.
        """
        logits = logits.float()
        logits = apply_penalties(logits, rows)
        logits = apply_logit_bias(logits, rows)
        logprobs_wanted = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if logprobs_wanted else None
        if grammar_mask is not None:  # [structured output]
            logits = apply_token_bitmask(logits, *grammar_mask)
        if all(r.params.greedy for r in rows):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows)
        return PendingSample(tokens, raw_logprobs, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        greedy = to_device([r.params.greedy for r in rows], torch.bool, device)
        temps = to_device([1.0 if r.params.greedy else r.params.temperature for r in rows],
                          torch.float32, device)
        scaled = apply_top_k_top_p_min_p(logits / temps.unsqueeze(1), rows)
        probs = torch.softmax(scaled, dim=-1)  # [B, V]
        noise = self._exponential_noise(rows, probs.shape[1], device)  # [B, V]
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self._generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device).manual_seed(self._seed)
        return self._device_generators[device]

    def _exponential_noise(
        self, rows: list[SamplingRow], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """[B, V] Exp(1) noise: unseeded rows from the engine's generator on the device;
        seeded rows from their own CPU generator (the same draws on any device)."""
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        shape = (len(unseeded), vocab)
        free = torch.empty(shape, device=device).exponential_(
            generator=self._generator_for(device)) if unseeded else None
        if not seeded and free is not None:
            return free.clamp_min_(1e-10)
        own = torch.empty(len(seeded), vocab)  # [S, V]
        for k, i in enumerate(seeded):
            row = rows[i]
            gen = torch.Generator().manual_seed(_row_seed(row.params.seed or 0, row.output_index))
            own[k].exponential_(generator=gen)
        noise = torch.empty(len(rows), vocab, device=device)
        noise.index_copy_(0, to_device(seeded, torch.long, device), host_to_device(own, device))
        if free is not None:
            noise.index_copy_(0, to_device(unseeded, torch.long, device), free)
        return noise.clamp_min_(1e-10)


def _row_seed(seed: int, index: int) -> int:
    return (seed * _SEED_MIX + index * 0x632BE59BD9B4E019 + 1) % (2**63 - 1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output, multiplicative) and presence/frequency (output only)."""
    targets = [
        i
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0
        or r.params.presence_penalty != 0.0
        or r.params.frequency_penalty != 0.0
    ]
    if not targets:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in targets:
        p = rows[i].params
        row = logits[i]  # [V]
        out_ids = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(row.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt_ids = torch.tensor(rows[i].prompt_token_ids, dtype=torch.long)
            seen[prompt_ids[prompt_ids < vocab].to(logits.device)] = True
            penalised = torch.where(
                row > 0, row / p.repetition_penalty, row * p.repetition_penalty
            )
            row.copy_(torch.where(seen, penalised, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits (greedy rows too: a bias of -100 bans a
    token, +100 all but forces it, which classification jobs rely on). logits: [B, V]."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            row_idx.append(i)
            token_idx.append(token)
            values.append(bias)
    if not values:
        return logits
    device = logits.device
    logits = logits.clone()
    logits.index_put_(
        (to_device(row_idx, torch.long, device), to_device(token_idx, torch.long, device)),
        to_device(values, logits.dtype, device), accumulate=True,
    )
    return logits


def apply_token_bitmask(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    """Set to -inf the tokens a grammar forbids, in the constrained rows only.

    logits: [B, V] on any device; bitmask: [len(rows), ceil(V / 32)] int32 on the CPU, bit j
    of word w allows token 32 * w + j (llguidance's and xgrammar's layout). Free rows are
    untouched. On a GPU: one transfer, the unpack and one masked copy on the device. On the
    CPU the unpack is numpy's (single-threaded) and torch runs one op: each parallel torch
    op is a thread barrier, and on a busy CPU a few of them cost more than the work.
    """
    if logits.device.type == "cpu":
        return _apply_bitmask_numpy(logits, rows, bitmask)
    return _apply_bitmask_torch(logits, rows, bitmask)


def _apply_bitmask_numpy(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [R, 32W]
    forbid = np.zeros(logits.shape, dtype=np.bool_)  # [B, V]
    forbid[rows] = bits[:, :vocab] == 0
    return logits.masked_fill(torch.from_numpy(forbid), float("-inf"))


def _apply_bitmask_torch(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    words = bitmask.to(device, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
    index = torch.tensor(rows, device=device, dtype=torch.long)  # [R]
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [R, V]
    return logits.index_copy(0, index, masked)


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top-k, top-p and min-p exclude. logits: [B, V]."""
    vocab = logits.shape[1]
    device = logits.device
    k_host = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows]
    p_host = [r.params.top_p for r in rows]
    min_p_host = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_p_host):
        min_p = to_device(min_p_host, torch.float32, device)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if any(k < vocab for k in k_host) or any(p < 1.0 for p in p_host):
        top_k = to_device(k_host, torch.long, device)
        top_p = to_device(p_host, torch.float32, device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of better tokens
        drop |= mass_before >= top_p.unsqueeze(1)  # the top token always survives
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _gather_logprobs(
    logprobs: torch.Tensor | None, tokens: list[int], rows: list[SamplingRow]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    if logprobs is None:
        return [None] * len(rows)
    result: list[tuple[float, list[tuple[int, float]]] | None] = []
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None:
            result.append(None)
            continue
        chosen = float(logprobs[i, tokens[i]])
        top: list[tuple[int, float]] = []
        if n > 0:
            values, ids = logprobs[i].topk(n)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        result.append((chosen, top))
    return result
