"""How many KV splits a paged decode launch uses (``decode_attention.py``).

Split heuristic (``choose_num_kv_splits``): decode is bound by memory bandwidth, which
needs a few resident programs per SM. With ``S * Hkv`` programs from the batch, add
splits until about ``WAVES * num_SMs`` programs exist, but never give a split fewer
than ``MIN_TOKENS_PER_SPLIT`` tokens (below that the stage-2 traffic and per-program
overhead win) and never more than ``MAX_KV_SPLITS``. The context length comes from the
caller's ``max_seq_len`` hint, else from the block table's capacity, never from
``seq_lens`` (reading it would sync the GPU).

That rule is for launches inside a CUDA graph (the engine's decode steps), where stage 2
costs a few microseconds. Launched eagerly, stage 2 costs a second Triton launch from
Python plus two allocations — measured on the H100 (``ops/bench/engine/kernels.py``, eager):
batch 8 x 512 tokens took 0.147 ms with 2 splits and 0.023 ms with 1; batch 1 x 4,096
took 0.269 ms with 16 splits and 0.110 ms with 1. So eagerly a split must carry
``EAGER_MIN_TOKENS_PER_SPLIT`` tokens, which keeps everything below 16k tokens of context
in one launch, only a grid that does not fill the GPU once is split, and the partial
buffers are reused rather than allocated.

Which rule applies is the caller's explicit choice (``cuda_graph=True`` for a graph's
capture *and* for the warm-up before it), never read from the stream's capture state:
a warm-up that took the eager rule would leave the graph's split variant and the merge
kernel to compile during capture, where loading a module is refused.
"""

from __future__ import annotations

import functools

import torch

DEFAULT_NUM_SMS = 132  # H100 SXM; used when the tensors are not on a CUDA device
WAVES = 2
MIN_TOKENS_PER_SPLIT = 256
EAGER_MIN_TOKENS_PER_SPLIT = 8192
MAX_KV_SPLITS = 64


def eager_warmup_contexts(max_context: int) -> list[int]:
    """``max_seq_len`` hints whose eager launches (one sequence) compile every variant the
    eager rule can pick up to ``max_context``: one split, then split counts padded to each
    power of two (the merge kernel's ``SPLITS_PAD``)."""
    most = min(MAX_KV_SPLITS, max_context // EAGER_MIN_TOKENS_PER_SPLIT)
    contexts, pad = [1], 2
    while pad // 2 < most:  # a count in (pad / 2, pad] is padded to pad
        contexts.append(min(pad, most) * EAGER_MIN_TOKENS_PER_SPLIT)
        pad *= 2
    return contexts


@functools.cache
def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``DEFAULT_NUM_SMS`` off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = DEFAULT_NUM_SMS,
    eager: bool = False,
) -> int:
    """How many KV splits keep ~WAVES programs per SM without making splits too short
    (``eager``: launched outside a CUDA graph, where each split must pay for a launch)."""
    programs = max(1, num_seqs * num_kv_heads)
    if eager and programs >= num_sms:
        return 1
    min_tokens = EAGER_MIN_TOKENS_PER_SPLIT if eager else MIN_TOKENS_PER_SPLIT
    wanted = -(-WAVES * num_sms // programs)
    by_length = max(1, max_context) // min_tokens if eager else \
        -(-max(1, max_context) // min_tokens)
    return max(1, min(wanted, by_length, MAX_KV_SPLITS))
