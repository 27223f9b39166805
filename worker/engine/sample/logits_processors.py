"""Per-request transforms of a step's logits, vectorized over the batch on the device.

Each function takes logits ``[B, V]`` and the step's ``LogitsRow``s and touches only the
rows that ask for it. What is built on the host is O(rows) or O(the tokens that matter)
and goes up in one pinned, non-blocking copy per tensor (``transfer.to_device``); nothing
reads a device value back, so a step launched while the previous one runs stays
overlapped. Decisions (does any row ask? which rows?) come from host-side parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from protocol.sampling import SamplingParams
from worker.engine.runner.transfer import host_to_device, to_device

PROMPT_MASK = "prompt_mask"  # LogitsRow.cache key: [V] bool, the prompt's tokens
OUTPUT_IDS = "penalty_output_ids"  # LogitsRow.cache key: (int64 buffer, tokens in it)
ALLOWED_MASK = "allowed_mask"  # LogitsRow.cache key: [V] bool, its allowed_token_ids


class LogitsRow(Protocol):
    """What these transforms read of a row (``rows.SamplingRow`` is one)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]
    cache: dict[str, Any]
    bad_words_ids: tuple[tuple[int, ...], ...]
    pending_output: torch.Tensor | None  # [1] on the device: the token of the step in flight
    penalised: bool | None  # wants_penalties(params), answered once per request


def wants_penalties(params: Any) -> bool:
    return bool(params.wants_penalties)


def apply_penalties(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """Repetition (prompt + output, multiplicative) and presence/frequency (output only).

    Output tokens go up as one padded ``[P, L]`` tensor and are counted with one
    ``scatter_add``; each request's prompt mask is built on the device once and kept in its
    row cache (a prompt never changes). A row's token of the step still in flight is
    counted on the device from that step's sampled tokens (``LogitsRow.pending_output``),
    so a penalised row needs no read-back before it samples."""
    targets = [i for i, r in enumerate(rows) if r.penalised]
    if not targets:
        return logits
    device, vocab = logits.device, logits.shape[1]
    picked = [rows[i] for i in targets]
    histories = [_output_ids(r, vocab) for r in picked]
    padded = np.full((len(picked), max(1, max(len(h) for h in histories))), vocab,
                     dtype=np.int64)  # [P, L]; vocab: a spare column, dropped
    for j, history in enumerate(histories):
        padded[j, :len(history)] = history
    ids = host_to_device(torch.from_numpy(padded), device)
    counts = torch.zeros(len(picked), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(1, device=device).expand(ids.shape))
    _count_pending(counts, picked, vocab)
    counts = counts[:, :vocab]  # [P, V]
    present = counts > 0  # [P, V]
    index = to_device(targets, torch.long, device)
    sub = logits.index_select(0, index)  # [P, V]
    # A penalty no row asks for is skipped, not applied as 1 or 0: x / 1, x * 1 and
    # x - 0 * c are x exactly, so the logits are the same bits with fewer ops.
    reps = [r.params.repetition_penalty for r in picked]
    if any(value != 1.0 for value in reps):
        rep = to_device(reps, torch.float32, device).unsqueeze(1)
        prompts = [_token_mask(r, PROMPT_MASK, r.prompt_token_ids, vocab, device)
                   for r in picked]
        sub = torch.where(present | torch.stack(prompts),
                          torch.where(sub > 0, sub / rep, sub * rep), sub)
    freqs = [r.params.frequency_penalty for r in picked]
    pres = [r.params.presence_penalty for r in picked]
    if any(freqs):
        sub = sub - to_device(freqs, torch.float32, device).unsqueeze(1) * counts
    if any(pres):
        sub = sub - to_device(pres, torch.float32, device).unsqueeze(1) * present.to(sub.dtype)
    return logits.index_copy(0, index, sub)


def _output_ids(row: LogitsRow, vocab: int) -> np.ndarray:
    """[L] int64: the row's known output tokens (ids outside the vocabulary as ``vocab``),
    kept in its request's cache and extended by the tokens new since the last step, so a
    step's host work is O(new tokens) rather than O(output length) per penalised row.
    A history that got shorter (it never should) is rebuilt."""
    known = row.output_token_ids
    buffer, count = row.cache.get(OUTPUT_IDS) or (np.empty(0, dtype=np.int64), 0)
    if len(known) < count:
        buffer, count = np.empty(0, dtype=np.int64), 0
    if len(known) > count:
        new = np.fromiter(known[count:], dtype=np.int64, count=len(known) - count)
        new[(new < 0) | (new >= vocab)] = vocab
        if len(known) > len(buffer):  # grow by doubling
            grown = np.empty(max(64, 2 * len(known)), dtype=np.int64)
            grown[:count] = buffer[:count]
            buffer = grown
        buffer[count:len(known)] = new
        count = len(known)
        row.cache[OUTPUT_IDS] = (buffer, count)
    return buffer[:count]


def _count_pending(counts: torch.Tensor, rows: Sequence[LogitsRow], vocab: int) -> None:
    """Add, on the device, each row's token of the step still in flight (its
    ``pending_output``, still a placeholder on the host) to ``counts`` [P, V + 1]."""
    lines = [j for j, r in enumerate(rows) if r.pending_output is not None]
    if not lines:
        return
    device = counts.device
    tokens = torch.cat([rows[j].pending_output for j in lines]).to(device)  # type: ignore[misc]  # [Q]
    tokens = torch.where((tokens >= 0) & (tokens < vocab), tokens,
                         torch.full_like(tokens, vocab))  # vocab: the spare column
    counts.index_put_((to_device(lines, torch.long, device), tokens),
                      torch.ones(len(lines), device=device), accumulate=True)


def _token_mask(row: LogitsRow, key: str, token_ids: Sequence[int] | None, vocab: int,
                device: torch.device) -> torch.Tensor:
    """[V] bool: True at ``token_ids`` (those inside the vocabulary); built on the device
    once per request, then cached in the row under ``key`` (the prompt's tokens, the
    allowed ones: both fixed for the request's life)."""
    mask = row.cache.get(key)
    if mask is None:
        ids = [t for t in token_ids or () if 0 <= t < vocab]
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        if ids:
            mask[to_device(ids, torch.long, device)] = True
        row.cache[key] = mask
    return mask  # type: ignore[no-any-return]


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
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


def apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """-inf for every token outside each row's ``allowed_token_ids`` (vLLM's mask), in the
    rows that have one. logits: [B, V]; a row's [V] mask is built on the device once."""
    targets = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not targets:
        return logits
    device, vocab = logits.device, logits.shape[1]
    allowed = torch.stack([_token_mask(rows[i], ALLOWED_MASK, rows[i].params.allowed_token_ids,
                                       vocab, device) for i in targets])  # [A, V]
    index = to_device(targets, torch.long, device)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [A, V]
    return logits.index_copy(0, index, sub)


def apply_bad_words(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """-inf for the last token of each banned sequence whose other tokens end the row's
    output so far (vLLM's rule: a one-token word always, a longer one only as its
    completion). logits: [B, V].

    One entry per (row, sequence): the host lays out the E sequences' prefixes
    right-aligned in ``[E, P]`` (P: the longest prefix; -1 where there is nothing to
    match) and each banning row's last P output tokens once (-2 where the output is
    shorter, which no token equals); the device compares them all at once and adds -inf
    (or 0) at each entry's last token in one ``index_put``."""
    entries = [(i, seq) for i, r in enumerate(rows) for seq in r.bad_words_ids]
    if not entries:
        return logits
    device = logits.device
    width = max(len(seq) for _, seq in entries) - 1
    penalty = torch.full((len(entries),), float("-inf"), device=device)  # [E]
    if width > 0:
        line_of: dict[int, int] = {}
        tails: list[list[int]] = []
        for i, _ in entries:
            if i not in line_of:
                line_of[i] = len(tails)
                out = list(rows[i].output_token_ids[-width:])
                tails.append([-2] * (width - len(out)) + out)
        prefix = to_device([[-1] * (width + 1 - len(seq)) + list(seq[:-1]) for _, seq in entries],
                           torch.long, device)  # [E, P]
        lines = to_device([line_of[i] for i, _ in entries], torch.long, device)  # [E]
        tail = to_device(tails, torch.long, device).index_select(0, lines)  # [E, P]
        hit = ((prefix == tail) | (prefix < 0)).all(dim=1)  # [E]
        penalty = torch.where(hit, penalty, torch.zeros_like(penalty))
    index = (to_device([i for i, _ in entries], torch.long, device),
             to_device([seq[-1] for _, seq in entries], torch.long, device))
    return logits.index_put(index, penalty.to(logits.dtype), accumulate=True)


def apply_token_bitmask(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    """Set to -inf the tokens a grammar forbids, in the constrained rows only.

    logits: [B, V] on any device; bitmask: [len(rows), ceil(V / 32)] int32 on the CPU, bit j
    of word w allows token 32 * w + j (llguidance's and xgrammar's layout). Free rows are
    untouched. On a GPU: one pinned transfer, the unpack and one masked copy on the device.
    On the CPU the unpack is numpy's (single-threaded) and torch runs one op: each parallel
    torch op is a thread barrier, and on a busy CPU a few of them cost more than the work.
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
    words = host_to_device(bitmask, device)  # [R, W]
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
    index = to_device(rows, torch.long, device)  # [R]
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [R, V]
    return logits.index_copy(0, index, masked)


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's min-p, top-k and top-p exclude, in that order;
    top-p is renormalised over what top-k kept (as vLLM). logits: [B, V].

    When every row that filters has a top-k, only ``torch.topk`` of the largest k is taken
    and top-p is applied inside it; a top-p without a top-k needs the full sort."""
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
    filtering = [i for i in range(len(rows)) if k_host[i] < vocab or p_host[i] < 1.0]
    if not filtering:
        return logits
    width = max(k_host[i] for i in filtering)  # == vocab when a row has top-p alone
    index = to_device(filtering, torch.long, device)
    sub = logits.index_select(0, index)  # [F, V]
    if width < vocab:
        top, order = sub.topk(width, dim=-1)  # [F, K], sorted
    else:
        top, order = sub.sort(dim=-1, descending=True)  # [F, V]
    top_k = to_device([k_host[i] for i in filtering], torch.long, device)
    top_p = to_device([p_host[i] for i in filtering], torch.float32, device)
    drop = torch.arange(width, device=device).unsqueeze(0) >= top_k.unsqueeze(1)  # [F, K]
    probs = torch.softmax(top.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of better tokens
    drop |= mass_before >= top_p.unsqueeze(1)  # the top token always survives
    kept = torch.full_like(sub, float("-inf")).scatter_(1, order, top.masked_fill(drop, -torch.inf))
    return logits.index_copy(0, index, kept)
