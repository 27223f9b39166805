"""What one forward pass hands the attention layers: metadata, backend protocol, context.

``AttentionMetadata`` says where every token lives in the paged cache, ``AttentionBackend``
is what a backend implements, and ``ForwardContext`` is passed explicitly to every layer.

Its own module so that the backends (``attention_torch``, ``attention_triton``) and the
dispatch (``attention``) all depend on it, and never on each other in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, D]


@dataclass
class AttentionMetadata:
    """Where every token of the step lives in the paged cache, built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    num_decodes: int  # sequences [0, num_decodes) have exactly one query token
    max_decode_seq_len: int  # longest context among the decodes (0 if none)
    # Decode rows split into (start, end, longest context) slices of similar length, so
    # the CPU path pads each slice only to its own longest sequence.
    decode_buckets: list[tuple[int, int, int]]
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens, for backends that loop over
    # sequences on the host (reading the tensors would sync a GPU).
    query_start_host: list[int]
    seq_lens_host: list[int]
    # Built for a CUDA graph bucket (decode_graphs.py): its capture and the warm-up before
    # it launch the same kernel variants (the split-KV count that fills the GPU, fresh
    # split buffers); False is an eager step (splits only where they pay for a launch).
    cuda_graph: bool = False


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        sinks: torch.Tensor | None = None,  # [Hq] attention-sink logits (gpt-oss)
        chunk: int | None = None,  # chunked local attention (Llama 4)
    ) -> torch.Tensor: ...  # [T, Hq, D]


@dataclass
class ForwardContext:
    """Everything the attention layers need for one forward pass."""

    meta: AttentionMetadata
    kv_caches: list[KVCache]  # one per layer
    backend: AttentionBackend
    # [T] each token's absolute position: layers that scale queries by position (Llama 4's
    # NoPE temperature) read it here; None where no such layer runs
    positions: torch.Tensor | None = None
