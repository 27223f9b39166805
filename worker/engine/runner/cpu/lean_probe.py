"""The lean path checked against the module path at load: a short prompt and two decode
steps on scratch caches, run both ways, the logits compared bit for bit.

Why: a family's description (``layer_plan.FamilySpec``) copies what its transformers
modules do today. A model whose modules do something the description does not say (a
config switch the description has no field for, a transformers release that changes a
formula) would give other logits on the lean path without an error. The probe catches
that at load, and the model keeps the module path (``lean_decode_off``, with the step
and the difference), so the difference is never served.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.engine.runner.attention.metadata import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    KVCache,
)

PROMPT = 5  # tokens of the probe's prompt, then two decode steps
STEPS = 3
_BLOCK = 16  # one cache block holds the whole probe


def _meta(start: int, count: int) -> AttentionMetadata:
    """One sequence whose tokens [start, start + count) run this step."""
    end = start + count
    decode = count == 1 and start > 0
    return AttentionMetadata(
        slot_mapping=torch.arange(start, end), query_start_loc=torch.tensor(
            [0, count], dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), num_decodes=int(decode),
        max_decode_seq_len=end if decode else 0,
        decode_buckets=[(0, 1, end)] if decode else [], max_query_len=count,
        max_seq_len=end, query_start_host=[0, count], seq_lens_host=[end])


def _caches(lean: Any) -> list[KVCache]:
    shape = (1, _BLOCK, lean.num_kv_heads, lean.head_dim)  # [blocks, block, Hkv, D]
    return [(torch.zeros(shape, dtype=lean.dtype), torch.zeros(shape, dtype=lean.dtype))
            for _ in lean.layers]


def probe_mismatch(model: Any, lean: Any, backend: AttentionBackend) -> str | None:
    """None when the lean path gives the module path's logits on the probe, else where
    and by how much it does not (or why the probe could not run)."""
    vocab = int(lean.vocab_size)
    ids = (torch.arange(PROMPT) * 7 + 3) % vocab  # [PROMPT]
    module_caches, lean_caches = _caches(lean), _caches(lean)
    start = 0
    with torch.inference_mode():
        for step in range(STEPS):
            count = ids.shape[0]
            meta = _meta(start, count)
            positions = torch.arange(start, start + count)  # [T]
            rows = torch.tensor([count - 1])
            try:
                ctx = ForwardContext(meta=meta, kv_caches=module_caches, backend=backend,
                                     positions=positions)
                want = model(input_ids=ids[None], position_ids=positions[None],
                             use_cache=False, logits_to_keep=rows, ferry_ctx=ctx).logits[0]
                got = lean(ids, positions, meta, lean_caches, rows)
            except Exception as exc:  # any failure keeps the module path
                return f"the probe failed at step {step}: {type(exc).__name__}: {exc}"
            if got.shape != want.shape or not torch.equal(got, want):
                diff = float((got.float() - want.float()).abs().max()) \
                    if got.shape == want.shape else float("nan")
                return f"the probe's step {step} differs from the module path by {diff:.3g}"
            start += count
            ids = want.argmax(-1)  # [1]: the next token
    return None
