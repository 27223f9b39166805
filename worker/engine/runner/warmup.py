"""Compile, before the worker serves, every Triton kernel variant a step can launch.

Triton compiles a kernel variant the first time a launch needs it, about a second during
which the engine loop, and every request in its batch, stalls. Variants differ by their
compile-time constants (the prefill's query tile follows the step's longest query by
powers of two; the split-KV merge is padded to a power of two of splits, which eagerly
only long contexts use) and by launch-time specializations, which the kernels keep to the
ones that matter (see ``kernels``). The warm-up runs the model over synthetic steps: one
prefill per query-tile size and one eager decode per split width, with K/V written to
blocks no request owns yet (the pool is empty at start; every block is written before it
is read). The decode graphs' own variants are compiled by the warm-up before each capture
(``decode_graphs.py``).

A failure here, other than a device fault, means the Triton kernels cannot serve this
model on this device: the worker falls back to the torch attention backend, degraded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from worker.engine.health import is_device_fault
from worker.engine.runner.attention.layer_features import model_body
from worker.engine.runner.attention.metadata import AttentionMetadata, ForwardContext
from worker.engine.runner.attention.torch_backends import TorchAttentionBackend

log = structlog.get_logger("ferry.worker.warmup")


def warm_up_kernels(runner: Any) -> None:
    """Run the synthetic steps on ``runner`` (Triton backend only); degrade on failure.
    Only at start: the steps overwrite blocks that, later, could hold cached prefixes."""
    if runner.backend.name != "triton":
        return
    from kernels.decode_splits import eager_warmup_contexts
    from kernels.prefill_attention import warmup_query_lens

    room = runner.num_blocks * runner.block_size  # tokens the free pool can take
    try:
        with torch.inference_mode():
            for q_len in warmup_query_lens():
                _forward(runner, min(q_len, room), decode=False, hint=min(q_len, room))
            for hint in eager_warmup_contexts(runner.shape.max_model_len):
                _forward(runner, 1, decode=True, hint=hint)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
    except Exception as exc:
        if is_device_fault(exc):
            raise
        runner.health.degrade("attention_kernel_failed", f"{type(exc).__name__}: {exc}",
                              fallback="torch")
        runner.backend = TorchAttentionBackend()
        return
    log.info("kernels_warmed_up", prefill_tiles=len(warmup_query_lens()),
             decode_widths=len(eager_warmup_contexts(runner.shape.max_model_len)))


def _forward(runner: Any, q_len: int, *, decode: bool, hint: int) -> None:
    """One sequence of ``q_len`` tokens at positions [0, q_len) in blocks 0, 1, ...; a decode
    (one token) gets ``hint`` as its context bound, so the kernel picks that split width."""
    dev, bs = runner.device, runner.block_size
    table = torch.zeros(1, runner.tables.max_blocks, dtype=torch.int32)
    used = -(-q_len // bs)
    table[0, :used] = torch.arange(used, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(q_len, device=dev),  # block p // bs is block p // bs
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([q_len], dtype=torch.int32, device=dev),
        block_tables=table.to(dev), num_decodes=1 if decode else 0,
        max_decode_seq_len=hint if decode else 0,
        decode_buckets=[(0, 1, q_len)] if decode else [], max_query_len=q_len,
        max_seq_len=q_len, query_start_host=[0, q_len], seq_lens_host=[q_len],
    )
    positions = torch.arange(q_len, device=dev)
    ctx = ForwardContext(meta=meta, kv_caches=runner.kv_caches, backend=runner.backend,
                         positions=positions)
    model_body(runner.model)(input_ids=torch.zeros(1, q_len, dtype=torch.long, device=dev),
                             position_ids=positions[None], use_cache=False, ferry_ctx=ctx)



def warm_up_sampling(runner: Any, sampler: Any,
                     build: Callable[[torch.device, torch.dtype, int], None] | None = None
                     ) -> None:
    """Build the fused sampling kernel at start (CUDA only) for the logits a step hands it.
    A kernel that does not build (Triton 3.6 once rejected it) makes the worker degraded,
    loudly, and it samples with the torch twin: the same tokens, more memory traffic,
    never a failed step."""
    if runner.device.type != "cuda":
        return
    try:
        (build or _build_sampling)(runner.device, runner.loaded.dtype, runner.shape.vocab_size)
    except Exception as exc:
        if is_device_fault(exc):
            raise
        runner.health.degrade("sampling_kernel_failed", f"{type(exc).__name__}: {exc}"[:2000],
                              fallback="torch")
        sampler.fused = False


def _build_sampling(dev: torch.device, dtype: torch.dtype, vocab: int) -> None:
    """One sampled row through each variant a step launches: the model's dtype, and
    float32 with a logit bias (the logits after penalties)."""
    from kernels.sampling import sample  # Triton: GPU workers only
    from kernels.sampling_reference import SamplingTensors

    host = ((0.8, 0.9, 0.0, 50.0),)
    params = torch.tensor(host, device=dev)
    keys = torch.ones(1, dtype=torch.long, device=dev)
    plain = SamplingTensors(params, keys, host)
    biased = SamplingTensors(params, keys, host,
                             torch.tensor([0, 1], dtype=torch.int32, device=dev),
                             torch.zeros(2, 1, dtype=torch.int32, device=dev),
                             torch.ones(1, device=dev))
    sample(torch.zeros(1, vocab, dtype=dtype, device=dev), plain)
    sample(torch.zeros(1, vocab, dtype=torch.float32, device=dev), biased)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
