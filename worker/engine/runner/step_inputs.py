"""A step's inputs: flat arrays built on the host by array indexing over the batch's rows,
and the block tables kept on the device.

Input ids, positions, slot mapping, query start offsets, context lengths and the rows
whose logits are sampled come from the scheduler's rows (``batch_rows.py``: computed
counts, each row's newest token) and the block manager's host tables
(``host_tables.py``), with no Python loop over the decodes: only a prefill chunk copies
its tokens from its request's list. A token still being read back from the step before
(a placeholder, ``inflight.py``) is located here too — the flat position it fills and its
row in that step's sampled tokens — and copied in on the device (``patch_placeholders``).
The block tables are the device twin of the host tables (``BlockTableBuffer``), updated
by the entries that changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.engine.kv.host_tables import HostTables
from worker.engine.request import PLACEHOLDER
from worker.engine.runner.transfer import host_to_device
from worker.engine.sched.schedule_output import SchedulerOutput

if TYPE_CHECKING:
    from worker.engine.inflight import InflightStep


_DECODE_BUCKET = 16  # sequences per decode attention call on the torch CPU path


def decode_buckets(lens: list[int] | np.ndarray,
                   size: int = _DECODE_BUCKET) -> list[tuple[int, int, int]]:
    """(start, end, longest) slices of the length-sorted decode rows."""
    n = len(lens)
    if not n:
        return []
    starts = np.arange(0, n, size)
    longest = np.maximum.reduceat(np.asarray(lens), starts).tolist()
    return [(lo, min(lo + size, n), top)
            for lo, top in zip(starts.tolist(), longest, strict=True)]


@dataclass(eq=False)
class StepInputs:
    ids: np.ndarray  # [T] int64, PLACEHOLDER where ``patch_dst`` says
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    query_start: np.ndarray  # [n + 1] int64
    seq_lens: np.ndarray  # [n] int64
    rows: np.ndarray  # [n] int64: each sequence's row in the device block tables
    sample_rows: np.ndarray  # [k] int64: flat index of each sampling row's last token
    num_new: np.ndarray  # [n] int64
    num_decodes: int
    patch_dst: np.ndarray  # [p] int64: flat positions of placeholder tokens...
    patch_src: np.ndarray  # [p] int64: ...and their rows in the previous step's tokens


def step_arrays(sched: SchedulerOutput, host: HostTables) -> tuple[np.ndarray, ...]:
    """(rows, num_new, sample, computed) of ``sched``'s requests, in order: its own arrays
    when the scheduler made them and every row is still its request's, else read from the
    requests (an output built or filtered by hand)."""
    if sched.rows is not None and sched.num_new is not None and sched.sample is not None \
            and sched.batch is not None and sched.host is host and sched.intact():
        return sched.rows, sched.num_new, sched.sample, sched.batch.computed[sched.rows]
    items = sched.scheduled
    rows = [host.row_of(s.request.request_id) for s in items]
    if None in rows:
        missing = next(s.request.request_id for s, r in zip(items, rows, strict=True)
                       if r is None)
        raise RuntimeError(f"request {missing!r} is scheduled but holds no blocks")
    return (np.array(rows, dtype=np.int64),
            np.array([s.num_new_tokens for s in items], dtype=np.int64),
            np.array([s.sample for s in items], dtype=bool),
            np.array([s.request.num_computed_tokens for s in items], dtype=np.int64))


def build_inputs(sched: SchedulerOutput, host: HostTables, block_size: int,
                 prev: InflightStep | None) -> StepInputs:
    rows, num_new, sample, start = step_arrays(sched, host)
    n = len(rows)
    one_each = sched.num_batched_tokens == n and sched.num_new is num_new
    ends = np.arange(1, n + 1) if one_each else np.cumsum(num_new)  # [n]
    total = int(ends[-1])
    if total == n:  # one token per row (decodes)
        ids, positions, row_of_token = _newest_tokens(sched, rows, start), start, rows
    else:
        firsts = ends - num_new
        positions = np.repeat(start - firsts, num_new) + np.arange(total)
        row_of_token = np.repeat(rows, num_new)
        ids = np.empty(total, dtype=np.int64)
        newest = num_new == 1
        ids[firsts[newest]] = _newest_tokens(sched, rows[newest], start[newest],
                                             newest.nonzero()[0])
        for i in (~newest).nonzero()[0].tolist():  # prefill chunks copy their tokens
            lo, count = int(start[i]), int(num_new[i])
            request = sched.scheduled[i].request
            chunk = request.all_token_ids[lo:lo + count]
            if len(chunk) < count:  # a drafted row: its last token, then the draft
                chunk = chunk + sched.drafts[request.request_id][:count - len(chunk)]
            ids[firsts[i]:firsts[i] + count] = chunk
    blocks = host.table[row_of_token, positions // block_size].astype(np.int64)
    dst = (ids == PLACEHOLDER).nonzero()[0]
    last = ends - 1
    return StepInputs(
        ids=ids, positions=positions, slots=blocks * block_size + positions % block_size,
        query_start=np.concatenate([[0], ends]), seq_lens=start + num_new, rows=rows,
        sample_rows=last if len(sched.sampling) == n else last[sample], num_new=num_new,
        num_decodes=n if total == n else int(np.count_nonzero(num_new == 1)),
        patch_dst=dst,
        patch_src=_placeholder_sources(sched, dst, row_of_token[dst], ends, prev, host))


def _newest_tokens(sched: SchedulerOutput, rows: np.ndarray, start: np.ndarray,
                   which: np.ndarray | None = None) -> np.ndarray:
    """The token at ``start`` of each of ``rows`` (positions ``which`` of ``sched``): the
    row's newest (kept in ``BatchRows.last``) when it is, else read from the request."""
    batch = sched.batch
    if batch is not None:
        ids = batch.last[rows]
        older = (start + 1 != batch.tokens[rows]).nonzero()[0]
    else:
        ids = np.empty(len(rows), dtype=np.int64)
        older = np.arange(len(rows))
    for j in older.tolist():
        i = j if which is None else int(which[j])
        ids[j] = sched.scheduled[i].request.all_token_ids[int(start[j])]
    return ids


def _placeholder_sources(sched: SchedulerOutput, dst: np.ndarray, dst_rows: np.ndarray,
                         ends: np.ndarray, prev: InflightStep | None,
                         host: HostTables) -> np.ndarray:
    """Each placeholder's row in ``prev``'s sampled tokens. A placeholder can only be the
    newest token of a request that sampled in ``prev`` and kept running (so kept its row):
    ``prev``'s sampling rows, in order, are the rows of its sampled tokens."""
    if not len(dst):
        return dst
    if prev is None:
        raise RuntimeError("a placeholder input token with no step in flight to fill it")
    p = prev.sched
    if p.rows is not None and p.sample is not None and p.host is host:
        sampled = p.rows[p.sample]
        where = np.full(max(host.rows, int(sampled.max(initial=0)) + 1), -1, dtype=np.int64)
        where[sampled] = np.arange(len(sampled))
        src = where[dst_rows]
        if not (src < 0).any():
            return src  # type: ignore[no-any-return]
    seqs = np.searchsorted(ends, dst, side="right")  # the sequence of each placeholder
    return np.array([prev.row_of[sched.scheduled[i].request.request_id]
                     for i in seqs.tolist()], dtype=np.int64)


def to_device_packed(arrays: list[np.ndarray], device: torch.device,
                     pack: bool | None = None) -> list[torch.Tensor]:
    """1-D int64 / int32 arrays moved in one copy; returns views of it, one per array, of
    the array's dtype. Each view starts 16 bytes aligned, as a tensor of its own would:
    Triton specializes its kernels on pointer alignment (the warm-up compiled them for
    aligned inputs). On a CPU (``pack`` unset) nothing moves: each array is wrapped as it
    is (each is made fresh for its step, so nothing else writes it)."""
    if not (device.type == "cuda" if pack is None else pack):
        return [torch.from_numpy(a) for a in arrays]
    spans = []
    top = 0  # in int64 words; every array starts at an even one (16 bytes)
    for a in arrays:
        words = (len(a) * a.itemsize + 7) // 8
        spans.append((top, words))
        top += words + (words & 1)
    flat = np.empty(top, dtype=np.int64)
    for a, (lo, words) in zip(arrays, spans, strict=True):
        if a.dtype == np.int64:
            flat[lo:lo + words] = a
        else:
            flat[lo:lo + words].view(a.dtype)[:len(a)] = a
    dev = host_to_device(torch.from_numpy(flat), device)
    views = []
    for a, (lo, words) in zip(arrays, spans, strict=True):
        if a.dtype == np.int64:
            views.append(dev[lo:lo + words])
        else:
            view = dev[lo:lo + words].view(torch.int32)
            views.append(view if 2 * words == len(a) else view[:len(a)])
    return views


def patch_placeholders(input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                       prev: InflightStep | None) -> None:
    """Copy, on the device, each placeholder input token from ``prev``'s sampled tokens."""
    if dst.numel() == 0:
        return
    assert prev is not None
    input_ids.index_copy_(0, dst, prev.sample.tokens.index_select(0, src))


class BlockTableBuffer:
    """Block tables kept on the device, updated by the entries that changed.

    Rebuilding every request's block table from Python lists each step costs O(batch x
    blocks) host work and a transfer of the same size; at a batch of 256 requests with 800
    tokens of context that is ~13k ints per step for tables that gained at most one entry per
    request. Here the device holds one persistent tensor ``[rows, max_blocks_per_seq]`` whose
    rows are the block manager's host rows (``host_tables.py``: a request keeps its row while
    it holds blocks). A step writes only the entries the host marked dirty since the last
    step — a new row (admission, or a table rebuilt after preemption) or the entries appended
    — with one scatter, then gathers the step's rows in batch order (on the device). Host
    work is O(entries changed) plus array indexing, and the tensor's address never changes,
    which CUDA graph replay needs.
    """

    def __init__(self, rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.max_blocks = max_blocks_per_seq
        self.table = torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32, device=device)

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def sync(self, host: HostTables) -> None:
        """Write the entries ``host`` changed since the last call (one scatter). Its
        ``dirty`` map is taken as its arrays are read: as plain attributes."""
        dirty, host.dirty = host.dirty, {}
        if not dirty:
            return
        rows = np.fromiter(dirty.keys(), dtype=np.int64, count=len(dirty))
        starts = np.fromiter(dirty.values(), dtype=np.int64, count=len(dirty))
        ends = host.length[rows]
        too_long = ends > self.max_blocks
        if too_long.any():  # the others are still written: they are valid
            longest = int(ends.max())
            self._write(host, rows[~too_long], starts[~too_long], ends[~too_long])
            raise ValueError(f"a block table has {longest} blocks, more than "
                             f"the {self.max_blocks} a sequence may hold")
        self._write(host, rows, starts, ends)

    def _write(self, host: HostTables, rows: np.ndarray, starts: np.ndarray,
               ends: np.ndarray) -> None:
        counts = ends - starts
        keep = counts > 0
        rows, starts, counts = rows[keep], starts[keep], counts[keep]
        if not len(rows):
            return
        while int(rows.max()) >= self.rows:  # more holders than expected: grow (eager only)
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        r = np.repeat(rows, counts)  # [U]
        c = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - starts,
                                                     counts)
        idx = host_to_device(torch.from_numpy(
            np.stack([r, c, host.table[r, c].astype(np.int64)])), self.device)  # [3, U]
        self.table.index_put_((idx[0], idx[1]), idx[2].to(torch.int32))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The tables of ``rows`` (on the device), ``[len(rows), max_blocks_per_seq]`` int32."""
        return self.table.index_select(0, rows)
