"""Owns the model and the KV tensors; turns a SchedulerOutput into logits.

Inputs are one flattened ragged batch with no padding: input ids, positions, slot
mapping, query start offsets and context lengths, built on the host with plain lists
(O(tokens of the step)) and moved to the device once per step without a host sync
(``transfer.py``); block tables stay on the device and change only by the entries that
changed (``step_inputs.BlockTableBuffer``). A token still being read back from the previous
step (a placeholder, ``inflight.py``) is copied in on the device from that step's
sampled tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import structlog
import torch

from worker.engine.config import CacheConfig, ModelConfig
from worker.engine.distributed.group import agree_min
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.health import EngineHealth
from worker.engine.inflight import InflightStep
from worker.engine.kv.block_manager import BlockManager
from worker.engine.kv.pool import PoolLayout
from worker.engine.kv.tier_mirror import TierMirror, lead_flush
from worker.engine.lora.config import LoraConfig
from worker.engine.lora.manager import LoraManager
from worker.engine.lora.targets import check_all_cut
from worker.engine.runner import kv_budget
from worker.engine.runner.attention.interface import make_backend
from worker.engine.runner.attention.kv_scales import use_checkpoint_kv_scales
from worker.engine.runner.attention.layer_features import model_body
from worker.engine.runner.attention.metadata import AttentionMetadata, ForwardContext
from worker.engine.runner.cpu.lean_decode import build_lean_decode
from worker.engine.runner.cpu.step_threads import serial_if, serial_tokens
from worker.engine.runner.decode_graphs import CudaGraphCapturer, DecodeGraphs, GraphCapturer
from worker.engine.runner.model_loader import LoadedModel, LogitsHead, ModelShape, load_model
from worker.engine.runner.step_inputs import (
    BlockTableBuffer,
    build_inputs,
    decode_buckets,
    patch_placeholders,
    to_device_packed,
)
from worker.engine.runner.tp_ranks import RankLead, step_message
from worker.engine.runner.transfer import to_device
from worker.engine.runner.warmup import warm_up_kernels
from worker.engine.sched.schedule_output import SchedulerOutput

_log = structlog.get_logger("ferry.worker.runner")
_MAX_GRAPH_BATCH = 512  # decode batches above this run eagerly

class ModelRunner:
    def __init__(
        self, model_cfg: ModelConfig, cache_cfg: CacheConfig, max_num_seqs: int = 64,
        lora: LoraConfig | None = None, tp: TPConfig | None = None,
        lead: RankLead | None = None,
    ) -> None:
        """``tp``: this process's rank of a tensor-parallel group (its shards, its heads'
        KV pool); ``lead``: on rank 0 of one, the followers each step is broadcast to."""
        if not 1 <= cache_cfg.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {cache_cfg.block_size}")
        self.tp = tp or TPConfig()
        self.lead = lead
        self.loaded: LoadedModel = load_model(model_cfg, self.tp)
        self.model_name = model_cfg.model
        self.lora: LoraManager | None = None  # enable_lora
        self.model = self.loaded.model
        self.device = self.loaded.device
        self.shape: ModelShape = self.loaded.shape
        self.block_size = cache_cfg.block_size
        self.health = EngineHealth()
        self.backend = make_backend(model_cfg.attention_backend, self.device, self.health)
        self.kv_dtype = kv_budget.kv_dtype(cache_cfg.kv_cache_dtype, self.loaded.dtype,
                                           self.backend.name)
        self.logits_head = LogitsHead(self.model)
        self.lean = build_lean_decode(self.model, self.backend) if (
            self.device.type == "cpu" and model_cfg.lean_decode and not self.tp.enabled) else None
        # CPU steps of at most this many tokens run on one thread (step_threads.py)
        self.serial_tokens = serial_tokens(self.model) if self.device.type == "cpu" else 0
        # one numbering on every rank
        self.num_blocks = agree_min(kv_budget.num_blocks(cache_cfg, self.device,
                                                         self.bytes_per_block))
        self.kv_pool, self.kv_caches = kv_budget.allocate(
            self.pool_layout, self.num_blocks, self.block_size, self.kv_dtype, self.device)
        self.tier_mirror = TierMirror()  # a follower's copy of rank 0's host tier
        if use_checkpoint_kv_scales(self.model, model_cfg.model, self.shape.num_layers,
                                    self.kv_dtype):
            if self.shape.v_in_k:  # one latent row serves as K and V: one scale for both
                raise ValueError(f"model {model_cfg.model!r}: per-layer FP8 KV cache scales "
                                 "are not implemented for the latent MLA cache")
            self.lean = None  # it attends outside the modules, where the scales live
        self.tables = BlockTableBuffer(
            max_num_seqs, -(-self.shape.max_model_len // self.block_size), self.device)
        self.graphs: DecodeGraphs | None = None
        if lora is not None:  # before the capture: the graphs record the LoRA kernels
            self.enable_lora(lora)
        if self.device.type == "cuda" and not self.tp.enabled:  # graphs refused under TP
            warm_up_kernels(self)
            if not model_cfg.enforce_eager:
                self.graphs = self.capture_graphs(CudaGraphCapturer(self.device),
                                                  min(max_num_seqs, _MAX_GRAPH_BATCH))

    def capture_graphs(self, capturer: GraphCapturer, max_batch: int) -> DecodeGraphs | None:
        """CUDA graphs for pure-decode steps, checked against eager forwards. A capture that
        fails or disagrees makes the worker degraded, loudly, and it runs eagerly (slower,
        correct) on its own stream."""
        before = _allocated(self.device)
        try:
            graphs = DecodeGraphs(self, max_batch, capturer)
            mismatch = graphs.verify()
        except Exception as exc:  # e.g. an architecture whose forward syncs the host
            self.health.degrade("decode_graphs_unavailable", f"{type(exc).__name__}: {exc}",
                                fallback="eager")
            self._release_graph_memory()
            return None
        if mismatch is not None:
            self.health.degrade("decode_graph_mismatch",
                                f"bucket {mismatch}: replayed logits differ from eager ones",
                                bucket=mismatch, fallback="eager")
            self._release_graph_memory()
            return None
        self.health.decode_graphs_active = True
        _log.info("decode_graphs_captured", buckets=len(graphs.buckets), max_batch=max_batch,
                  memory_mib=round((_allocated(self.device) - before) / 2**20, 1))
        return graphs

    def _release_graph_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def use_static_decode(self) -> None:
        """Run pure-decode steps through the static-buffer (graph) path uncaptured: on a
        CPU, tests compare it with the eager path token for token."""
        if self.tp.enabled:  # its steps would not reach the follower ranks
            raise ValueError("the static decode path is not served under tensor parallelism")
        self.graphs = DecodeGraphs(self, self.tables.rows, None)

    @property
    def pool_layout(self) -> PoolLayout:
        return kv_budget.pool_layout(self.shape)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes, every layer included."""
        return kv_budget.bytes_per_token(self.pool_layout, self.kv_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prepare(
        self, sched: SchedulerOutput, blocks: BlockManager, prev: InflightStep | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step: (input_ids [T], positions [T], metadata, logits rows [n])."""
        inp = build_inputs(sched, blocks.host, self.block_size, prev)
        self.tables.sync(blocks.host)
        ids, positions, slots, sample_rows, rows, dst, src, query_start, seq_lens = \
            to_device_packed([inp.ids, inp.positions, inp.slots, inp.sample_rows, inp.rows,
                              inp.patch_dst, inp.patch_src, inp.query_start.astype(np.int32),
                              inp.seq_lens.astype(np.int32)], self.device)
        nd, lens = inp.num_decodes, inp.seq_lens
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=query_start, seq_lens=seq_lens,
            block_tables=self.tables.gather(rows),
            num_decodes=nd,
            max_decode_seq_len=int(lens[:nd].max()) if nd else 0,
            decode_buckets=decode_buckets(lens[:nd]),
            max_query_len=1 if nd == len(lens) else int(inp.num_new.max()),
            max_seq_len=int(lens.max()),
            query_start_host=inp.query_start.tolist(),
            seq_lens_host=lens.tolist(),
        )
        patch_placeholders(ids, dst, src, prev)
        return ids, positions, meta, sample_rows

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, blocks: BlockManager, prev: InflightStep | None = None,
        extra_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Run one step; returns logits [num_sampled, vocab] for the rows that sample.
        ``prev``: the step launched before, whose sampled tokens fill the placeholders.
        ``extra_rows``: more flat token rows whose logits follow (prompt logprobs)."""
        with serial_if(sched.num_batched_tokens <= self.serial_tokens), (
                nullcontext() if self.lead is None else self.lead.guard()):
            return self._execute(sched, blocks, prev, extra_rows)

    def _execute(
        self, sched: SchedulerOutput, blocks: BlockManager, prev: InflightStep | None,
        extra_rows: list[int] | None,
    ) -> torch.Tensor:
        # the host tier's copies land before the forward (on every rank: tier_mirror.py)
        if self.lead is None:
            blocks.flush_copies(self.kv_pool)
        else:
            lead_flush(blocks, self.kv_pool, self.lead.send)
        if not extra_rows and self.graphs is not None and self.graphs.fits(
                len(sched.scheduled), sched.num_batched_tokens) and (
                bool(sched.sample.all()) if sched.sample is not None
                else all(item.sample for item in sched.scheduled)):
            return self._decode_static(sched, blocks, prev)
        if self.lora is not None:
            return self._execute_lora(sched, blocks, prev, extra_rows)
        return self._eager(sched, blocks, prev, extra_rows)

    def _eager(
        self, sched: SchedulerOutput, blocks: BlockManager, prev: InflightStep | None,
        extra_rows: list[int] | None,
    ) -> torch.Tensor:
        input_ids, positions, meta, sample_rows = self.prepare(sched, blocks, prev)
        if extra_rows:  # prompt logprobs' rows, or the drafts' of a verification step
            sample_rows = torch.cat([sample_rows, to_device(extra_rows, torch.long, self.device)])
        if self.lead is not None:
            self.lead.send(step_message(input_ids, positions, meta, sample_rows))
        return self.forward(input_ids, positions, meta, sample_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, sample_rows: torch.Tensor) -> torch.Tensor:
        """The model on one flattened step: logits [rows of sample_rows, vocab]."""
        if self.lean is not None and self.lean.usable(meta, self.kv_caches):
            return self.lean(input_ids, positions, meta, self.kv_caches, sample_rows)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend,
                             positions=positions)
        if sample_rows.numel() == 0:
            model_body(self.model)(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                ferry_ctx=ctx,
            )
            return torch.empty(0, self.shape.vocab_size, device=self.device)
        out = self.model(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
            logits_to_keep=sample_rows, ferry_ctx=ctx,
        )
        return out.logits[0]  # type: ignore[no-any-return]

    # --- multi-LoRA: the model's projections read the step's token -> slot map ---

    def enable_lora(self, cfg: LoraConfig) -> LoraManager:
        """Wrap the projections for LoRA (once). Given to the constructor, this runs before
        the decode graphs are captured, and they replay the LoRA kernels too (slot indices
        in a static buffer); enabled later, graphs captured without them are dropped."""
        if self.graphs is not None and self.lora is None:
            self.graphs = None
            self.health.decode_graphs_active = False
        if self.lora is None:
            self.lora = LoraManager(self.model, self.model_name, cfg, self.device,
                                    self.loaded.dtype)
            if self.tp.enabled:  # every adapter is cut like its projection
                check_all_cut(self.lora.cache.targets)
            if self.lead is not None:  # the followers replay its slot writes
                self.lora.lead_followers()
            if self.lean is not None:  # rebuilt over the wrappers (probed at load, unwrapped)
                self.lean = build_lean_decode(self.model, self.backend, probe=False)
        return self.lora

    def _execute_lora(
        self, sched: SchedulerOutput, blocks: BlockManager, prev: InflightStep | None,
        extra_rows: list[int] | None,
    ) -> torch.Tensor:
        assert self.lora is not None
        items = sched.scheduled
        self.lora.begin_step([s.request.request_id for s in items],
                             [s.num_new_tokens for s in items])
        if self.lead is not None:  # the step's adapters, before its inputs
            sync = self.lora.sync_followers()
            if sync is not None:
                self.lead.send(sync)
        try:
            return self._eager(sched, blocks, prev, extra_rows)
        finally:
            self.lora.end_step()

    def _decode_static(
        self, sched: SchedulerOutput, blocks: BlockManager, prev: InflightStep | None
    ) -> torch.Tensor:
        """A pure-decode step through the static buffers (a CUDA graph replay on a GPU)."""
        assert self.graphs is not None
        inp = build_inputs(sched, blocks.host, self.block_size, prev)
        self.tables.sync(blocks.host)
        rows, dst, src = to_device_packed([inp.rows, inp.patch_dst, inp.patch_src],
                                          self.device)
        lora = {} if self.lora is None else {"lora_slots": self.lora.row_slots(
            [item.request.request_id for item in sched.scheduled])}
        return self.graphs.run(inp.ids, inp.positions, inp.slots, inp.seq_lens,
                               self.tables.gather(rows),
                               lambda static_ids: patch_placeholders(static_ids, dst, src, prev),
                               **lora)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
