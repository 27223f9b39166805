"""Pure-decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step of a 1B model launches ~500 small kernels, and on a GPU the host time to
launch them (Python, transformers' modules, Triton's launcher) exceeds the device time.
A CUDA graph records the launches once and replays them with one call. What a graph
needs: inputs at fixed addresses with fixed shapes, no host syncs and no Python branching
on tensor values inside. So:

* **Static buffers** hold the step's inputs (token ids, positions, slot mapping, context
  lengths, block tables as wide as the longest allowed table); each step copies the real
  rows in and pads the batch to its bucket (1, 2, 4, 8, then multiples of 8).
* **Padded rows** are harmless: they decode one token at position 0, write its K/V into a
  scratch block that no request owns (the pool has one extra block), and attend only to
  it; their hidden states are dropped.
* **Metadata** is per bucket and fixed, and says so (``cuda_graph=True``): every row is a
  decode and the split-KV choice is made for the longest context the model allows (the
  kernel skips empty splits), so nothing on the host depends on this step's lengths. The
  warm-up before each capture runs the very same forward on the capture's stream, so every
  kernel variant the capture launches is compiled and loaded before capture begins.
* **Hidden states, not logits.** Every bucket's graph writes its last hidden states into
  one shared ``[max_batch, hidden]`` buffer; logits are computed after the replay, outside
  the graph, for the real rows only (``LogitsHead``). A graph holding ``[bucket, vocab]``
  logits per bucket would pin gigabytes of its pool for a large vocabulary.

Mixed steps (any prefill chunk) and batches larger than the largest bucket run eagerly.
On a CPU (tests) the same static-buffer path runs uncaptured, or through a stand-in
``GraphCapturer`` that records what the capture would launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import structlog
import torch

from worker.engine.runner.attention.layer_features import model_body
from worker.engine.runner.attention.metadata import AttentionMetadata, ForwardContext
from worker.engine.runner.transfer import host_to_device

log = structlog.get_logger("ferry.worker.graphs")
HostInts = Sequence[int] | np.ndarray  # a step's host inputs: lists or 1-D arrays


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to ``max_batch`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 8))
    return sorted({*sizes, max_batch})


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    """How graphs are made: ``warm_up`` runs a forward as the capture will (same stream),
    ``capture`` records it. ``CudaGraphCapturer`` on a GPU; tests pass stand-ins."""

    def warm_up(self, fn: Callable[[], None]) -> None: ...

    def capture(self, fn: Callable[[], None]) -> Replayable: ...


class CudaGraphCapturer:
    """Captures on one side stream into one shared memory pool (largest bucket first, so
    the smaller ones reuse its memory).

    Unlike ``torch.cuda.graph``, which leaves its side stream current when
    ``capture_end`` raises (every later kernel, eager fallback included, would then run on
    it), the caller's stream is current again however the capture ends.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def warm_up(self, fn: Callable[[], None]) -> None:
        self._on_side_stream(fn)

    def capture(self, fn: Callable[[], None]) -> Replayable:
        graph = torch.cuda.CUDAGraph()

        def record() -> None:
            graph.capture_begin(pool=self.pool)
            try:
                fn()
            except BaseException:
                with contextlib.suppress(Exception):  # end the capture; report fn's error
                    graph.capture_end()
                raise
            graph.capture_end()

        self._on_side_stream(record)
        return graph

    def _on_side_stream(self, fn: Callable[[], None]) -> None:
        caller = torch.cuda.current_stream(self.device)
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(caller)
        torch.cuda.set_stream(self.stream)
        try:
            fn()
        finally:
            torch.cuda.set_stream(caller)
        caller.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)


class DecodeGraphs:
    """``run(...)`` one pure-decode step through the bucket that fits it."""

    def __init__(self, runner: Any, max_batch: int, capturer: GraphCapturer | None) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.buckets = bucket_sizes(max_batch)
        self.scratch_block = runner.num_blocks  # the pool's extra block, owned by no one
        dev, width = runner.device, runner.tables.max_blocks
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), self.scratch_block * runner.block_size,
                                dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.tables = torch.full((max_batch, width), self.scratch_block, dtype=torch.int32,
                                 device=dev)
        self.starts = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        # [max_batch, hidden]: the one output every bucket's graph writes (rows [0, bucket))
        self.hidden = torch.zeros(max_batch, runner.shape.hidden_size,
                                  dtype=runner.loaded.dtype, device=dev)
        # multi-LoRA: each row's adapter slot (-1: none); the graphs record the LoRA
        # kernels reading it, so loading or evicting adapters never needs a recapture
        self.lora = runner.lora
        self.lora_slots = torch.full((max_batch,), -1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, Replayable] = {}
        if capturer is not None:
            self._capture_all(capturer)

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs == num_tokens and 0 < num_seqs <= self.max_batch

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _meta(self, size: int, cuda_graph: bool = True) -> AttentionMetadata:
        longest = self.tables.shape[1] * self.runner.block_size
        return AttentionMetadata(
            slot_mapping=self.slots[:size], query_start_loc=self.starts[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.tables[:size],
            num_decodes=size, max_decode_seq_len=longest,
            decode_buckets=[(0, size, longest)], max_query_len=1, max_seq_len=longest,
            query_start_host=list(range(size + 1)), seq_lens_host=[longest] * size,
            cuda_graph=cuda_graph,
        )

    def _context(self, size: int, cuda_graph: bool = True) -> ForwardContext:
        return ForwardContext(meta=self._meta(size, cuda_graph), kv_caches=self.runner.kv_caches,
                              backend=self.runner.backend, positions=self.positions[:size])

    def _forward(self, size: int) -> None:
        """The model body over the first ``size`` static rows, into ``hidden[:size]``: what
        a bucket's graph records, and what its warm-up runs first."""
        if self.lora is not None:
            self.lora.step.meta = self.lora.graph_metadata(self.lora_slots[:size])
        try:
            out = model_body(self.runner.model)(
                input_ids=self.ids[None, :size], position_ids=self.positions[None, :size],
                use_cache=False, ferry_ctx=self._context(size))
        finally:
            if self.lora is not None:
                self.lora.step.meta = None
        self.hidden[:size].copy_(out.last_hidden_state[0])

    @torch.inference_mode()
    def _capture_all(self, capturer: GraphCapturer) -> None:
        for size in reversed(self.buckets):  # largest first: later ones reuse its pool
            capturer.warm_up(lambda size=size: self._forward(size))  # type: ignore[misc]
            self.graphs[size] = capturer.capture(
                lambda size=size: self._forward(size))  # type: ignore[misc]

    @torch.inference_mode()
    def verify(self) -> int | None:
        """Replay each bucket on its padding inputs and compare its logits with the model's
        own eager forward (its own head included): a graph that recorded something
        host-dependent would differ. Returns the bucket that disagrees, else None."""
        for size, graph in self.graphs.items():
            graph.replay()
            replayed = self.runner.logits_head(self.hidden[:size]).float()
            eager = self.runner.model(
                input_ids=self.ids[None, :size], position_ids=self.positions[None, :size],
                use_cache=False, ferry_ctx=self._context(size, cuda_graph=False),
            ).logits[0].float()
            if not torch.allclose(replayed, eager, atol=1e-2, rtol=1e-2):
                return size
        return None

    @torch.inference_mode()
    def run(self, ids: HostInts, positions: HostInts, slots: HostInts,
            seq_lens: HostInts, tables: torch.Tensor,
            patch_ids: Callable[[torch.Tensor], None] | None = None,
            lora_slots: HostInts | None = None) -> torch.Tensor:
        """Fill the static rows, pad to the bucket, replay; logits [len(ids), vocab],
        computed outside the graph for the real rows. The inputs are lists or 1-D arrays;
        ``patch_ids`` fills, on the device, input tokens still being read back;
        ``lora_slots`` are the rows' adapter slots (LoRA on)."""
        n, size = len(ids), self._bucket(len(ids))
        rows = [ids, positions, slots, seq_lens]
        if self.lora is not None:
            rows.append(lora_slots if lora_slots is not None else [-1] * n)
        host = torch.from_numpy(np.stack([np.asarray(v, dtype=np.int64)
                                          for v in rows]))  # [4 or 5, n]
        dev = host_to_device(host, self.runner.device)
        self.ids[:n].copy_(dev[0])
        if patch_ids is not None:
            patch_ids(self.ids)
        self.positions[:n].copy_(dev[1])
        self.slots[:n].copy_(dev[2])
        self.seq_lens[:n].copy_(dev[3])
        self.tables[:n].copy_(tables)
        if self.lora is not None:
            self.lora_slots[:n].copy_(dev[4])
            self.lora_slots[n:size].fill_(-1)
        if size > n:  # padded rows: one token at position 0, in the scratch block
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.scratch_block * self.runner.block_size)
            self.seq_lens[n:size].fill_(1)
            self.tables[n:size, 0].fill_(self.scratch_block)
        graph = self.graphs.get(size)
        if graph is None:  # not captured (a CPU, or enforce_eager off the GPU path)
            self._forward(size)
        else:
            graph.replay()
        return self.runner.logits_head(self.hidden[:n])  # type: ignore[no-any-return]
