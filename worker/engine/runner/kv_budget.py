"""The device KV pool's element type, its size in blocks, and its allocation.

Apart from ``model_runner.py`` because it is decided once, at load, from the cache
config, the model's shape and the device's free memory, and never read by a step: the
runner keeps what it returns (``kv_dtype``, ``num_blocks``, the pool and its per-layer
views). The layout of the pool itself is ``kv/pool.py``'s.
"""

from __future__ import annotations

import torch

from worker.engine.config import CacheConfig
from worker.engine.kv.pool import KVCache, PoolLayout
from worker.engine.runner.model_loader import _DTYPES, ModelShape

# fp8_e4m3 (vLLM's "fp8" too): one byte a value, saturated at +-448 on store, scaled per
# layer where the checkpoint says so (attention/kv_scales.py)
KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
DEFAULT_CPU_KV_BYTES = 2 << 30
GRAPH_RESERVE_BYTES = 1 << 30  # left out of the KV budget for the graphs' memory pool


def kv_dtype(name: str, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The cache's element type for ``kv_cache_dtype`` ``name`` (``auto``: the model's);
    raises ValueError for a name not served, or one the ``backend``'s kernels cannot read."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, {', '.join(KV_DTYPES)}; got {name!r}")
    dtype = KV_DTYPES[name]
    if dtype not in (model_dtype, torch.float8_e4m3fn) and backend == "triton":
        raise ValueError(
            f"kv_cache_dtype {name} differs from the model's dtype "
            f"{str(model_dtype).removeprefix('torch.')}: the Triton attention "
            "kernels read a cache in the model's dtype or fp8_e4m3; use kv_cache_dtype=auto or "
            "load the model in that dtype (dtype=...)")
    return dtype


def pool_layout(shape: ModelShape) -> PoolLayout:
    """The widths one token's K/V take in every layer of a model of ``shape``."""
    return PoolLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.value_dim,
                      shape.v_in_k)


def bytes_per_token(layout: PoolLayout, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes, every layer included."""
    return layout.bytes_per_token(torch.empty((), dtype=dtype).element_size())


def num_blocks(cfg: CacheConfig, device: torch.device, bytes_per_block: int) -> int:
    """Blocks the pool holds: ``cfg.num_blocks`` when set, else as many as the budget
    (``cfg.memory_bytes``; on CUDA 90% of the free memory less the graphs' reserve, on a
    CPU ``DEFAULT_CPU_KV_BYTES``) holds."""
    if cfg.num_blocks is not None:
        if cfg.num_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {cfg.num_blocks}")
        return cfg.num_blocks
    budget = cfg.memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.9) - GRAPH_RESERVE_BYTES
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num = budget // bytes_per_block
    if num < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block")
    return int(num)


def allocate(layout: PoolLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, list[KVCache]]:
    """The whole pool, allocated once (``kv/pool.py``): (the pool as the host tier copies
    it, [layers][k|v] of [blocks, block_size, Hkv, D]), plus one scratch block owned by no
    request (the graphs' padded rows write there)."""
    pool, caches = layout.allocate(num_blocks + 1, block_size, dtype, device)
    # the host tier copies whole blocks of every layer at once, as bytes for an FP8 pool
    # (not every device has an FP8 index_put)
    return (pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool), caches
