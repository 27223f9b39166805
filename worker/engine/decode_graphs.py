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
  it; their logits are dropped.
* **Metadata** is per bucket and fixed: every row is a decode, and the split-KV choice is
  made for the longest context the model allows (the kernel skips empty splits), so
  nothing on the host depends on this step's lengths.

Mixed steps (any prefill chunk) and batches larger than the largest bucket run eagerly.
On a CPU (tests) the same static-buffer path runs uncaptured, which checks the padding,
the scratch block and the metadata against the eager path token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from worker.engine.attention_metadata import AttentionMetadata, ForwardContext

log = structlog.get_logger("ferry.worker.graphs")


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to ``max_batch`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 8))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    """``run(...)`` one pure-decode step through the bucket that fits it."""

    def __init__(self, runner: Any, max_batch: int, capture: bool) -> None:
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        if capture:
            self._capture_all()

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs == num_tokens and 0 < num_seqs <= self.max_batch

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _meta(self, size: int) -> AttentionMetadata:
        longest = self.tables.shape[1] * self.runner.block_size
        return AttentionMetadata(
            slot_mapping=self.slots[:size], query_start_loc=self.starts[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.tables[:size],
            num_decodes=size, max_decode_seq_len=longest,
            decode_buckets=[(0, size, longest)], max_query_len=1, max_seq_len=longest,
            query_start_host=list(range(size + 1)), seq_lens_host=[longest] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` static rows; logits [size, vocab]."""
        runner = self.runner
        ctx = ForwardContext(meta=self._meta(size), kv_caches=runner.kv_caches,
                             backend=runner.backend)
        out = runner.model(input_ids=self.ids[None, :size],
                           position_ids=self.positions[None, :size], use_cache=False,
                           ferry_ctx=ctx)
        return out.logits[0]  # type: ignore[no-any-return]

    @torch.inference_mode()
    def verify(self) -> bool:
        """Replay each bucket on its padding inputs and compare with an eager forward: a
        graph that recorded something host-dependent would differ (then run eagerly)."""
        for size, graph in self.graphs.items():
            graph.replay()
            eager = self._forward(size)
            if not torch.allclose(self.logits[size].float(), eager.float(), atol=1e-2,
                                  rtol=1e-2):
                log.warning("decode_graph_mismatch", bucket=size)
                return False
        return True

    @torch.inference_mode()
    def _capture_all(self) -> None:
        before = torch.cuda.memory_allocated(self.runner.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):  # largest first: later ones reuse its pool
            self._forward(size)  # warm-up: Triton compiles, lazy inits happen outside
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.runner.device)
        self.memory_bytes = torch.cuda.memory_allocated(self.runner.device) - before
        log.info("decode_graphs_captured", buckets=len(self.buckets),
                 max_batch=self.max_batch, memory_mib=round(self.memory_bytes / 2**20, 1))

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int],
            seq_lens: list[int], tables: torch.Tensor,
            patch_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Fill the static rows, pad to the bucket, replay; logits [len(ids), vocab].
        ``patch_ids`` fills, on the device, input tokens still being read back."""
        n, size = len(ids), self._bucket(len(ids))
        host = torch.tensor([ids, positions, slots, seq_lens], dtype=torch.long)  # [4, n]
        if self.runner.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.runner.device, non_blocking=True)
        self.ids[:n].copy_(dev[0])
        if patch_ids is not None:
            patch_ids(self.ids)
        self.positions[:n].copy_(dev[1])
        self.slots[:n].copy_(dev[2])
        self.seq_lens[:n].copy_(dev[3])
        self.tables[:n].copy_(tables)
        if size > n:  # padded rows: one token at position 0, in the scratch block
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.scratch_block * self.runner.block_size)
            self.seq_lens[n:size].fill_(1)
            self.tables[n:size, 0].fill_(self.scratch_block)
        graph = self.graphs.get(size)
        if graph is None:  # not captured (a CPU, or enforce_eager off the GPU path)
            return self._forward(size)[:n]
        graph.replay()
        return self.logits[size][:n]
