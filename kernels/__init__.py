"""Paged-attention kernels: Triton launchers for CUDA, pure-torch ``kernels.reference``.

Importing this package is cheap and safe without a GPU: it imports triton and defines
the ``@triton.jit`` kernels, but nothing touches CUDA until a launcher is called.
"""

from kernels import reference
from kernels.decode_attention import choose_num_kv_splits, paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv

__all__ = [
    "choose_num_kv_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
    "store_kv",
]
