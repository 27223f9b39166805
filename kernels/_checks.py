"""Shape, stride and dtype validation shared by the Triton launchers.

A Triton kernel handed a wrong shape or stride does not fail: it reads the wrong memory
and returns garbage, or faults the whole CUDA context. Every launcher therefore checks
its arguments on the host first and raises a ``ValueError`` that names the argument.
Only metadata is inspected (shapes, strides, dtypes, devices): checking *values*, such
as ``seq_lens`` fitting the block table, would need a device-to-host sync per call, so
that stays the caller's contract (the scheduler builds those tensors).

The launchers run once per layer per step, so the checks stay cheap: messages are
formatted only on failure (``if ...: raise``), never eagerly.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# An FP8 (e4m3) cache: the kernels widen each tile to the query dtype on load (unit scale)
FP8_KV = torch.float8_e4m3fn
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_KV)
MAX_HEAD_DIM = 576  # MLA's latent keys: kv_lora_rank 512 + rope 64
MAX_BLOCK_SIZE = 256


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    """Check rank, dtype and a unit stride on the last dim (the kernels assume it)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1 and t.numel() > 0:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor) -> None:
    """All given tensors must live on one device (Triton would read host memory as GPU)."""
    devices = [t.device for t in tensors.values()]
    if any(d != devices[0] for d in devices):
        named = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {named}")


def check_kv_cache(k_cache: object, v_cache: object, dtype: torch.dtype) -> tuple[int, int]:
    """Validate the paged caches; return ``(block_size, num_kv_heads)``.

    K and V must share strides, as the kernels take one set of cache strides (true for
    the pool's layouts, ``worker/engine/kv/pool.py``: two views of one ``[2, ...]``
    tensor, or column views of one row per token), and every dimension but the head size
    (MLA's values are narrower than its keys).
    """
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES)
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not 1 <= v.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"v head_dim must be in [1, {MAX_HEAD_DIM}], got {v.shape[3]}")
    if k.stride() != v.stride():
        raise ValueError(f"k_cache/v_cache strides differ: {k.stride()} vs {v.stride()}")
    if k.dtype != v.dtype or k.dtype not in (dtype, FP8_KV):
        raise ValueError(f"kv cache dtype {k.dtype}/{v.dtype} != query dtype {dtype}")
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if num_kv_heads < 1:
        raise ValueError("k_cache must have at least one kv head")
    return block_size, num_kv_heads


def check_heads(num_q_heads: int, num_kv_heads: int, q_head_dim: int, kv_head_dim: int) -> None:
    """Query heads must split evenly over KV heads, and head dims must agree."""
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if q_head_dim != kv_head_dim:
        raise ValueError(f"q head_dim ({q_head_dim}) != kv cache head_dim ({kv_head_dim})")
    if not 1 <= q_head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {q_head_dim}")


def check_block_tables(block_tables: object, seq_lens: object, num_seqs: int) -> None:
    """``block_tables`` [num_seqs, max_blocks] int32 and ``seq_lens`` [num_seqs] int32."""
    bt = check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    sl = check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    if bt.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {bt.shape[0]} rows but there are {num_seqs} sequences")
    if bt.shape[1] < 1:
        raise ValueError("block_tables needs at least one column")
    if sl.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {sl.shape[0]} entries, expected {num_seqs}")


def check_out(out: object, like: torch.Tensor,
              shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``out`` must have ``like``'s dtype and ``shape`` (default ``like``'s), contiguous
    in the last dim."""
    o = check_tensor("out", out, ndim=like.dim(), dtypes=(like.dtype,))
    want = tuple(like.shape) if shape is None else shape
    if tuple(o.shape) != want:
        raise ValueError(f"out shape {tuple(o.shape)} != {want}")
    return o


def window_arg(sliding_window: int | None) -> int:
    """Sliding window as a kernel int: 0 means no window (as in the reference, <= 0 is off)."""
    if sliding_window is None:
        return 0
    if not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window must be an int, got {type(sliding_window).__name__}")
    return max(0, sliding_window)


def soft_cap_arg(logits_soft_cap: float | None) -> float:
    """Logit soft cap as a kernel float: 0.0 means off (as in the reference, <= 0 is off)."""
    if logits_soft_cap is None:
        return 0.0
    return max(0.0, float(logits_soft_cap))


def sinks_arg(sinks: torch.Tensor | None, num_q_heads: int,
              device: torch.device) -> torch.Tensor | None:
    """Attention-sink logits as the kernels read them: [num_q_heads] contiguous fp32."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_q_heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a [{num_q_heads}] tensor (one per query head), "
                         f"got {shape}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}, the queries on {device}")
    return sinks.detach().to(torch.float32).contiguous()
