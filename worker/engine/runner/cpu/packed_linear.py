"""CPU: run the model's linear layers on oneDNN with weights packed once at load.

Why: ``nn.Linear`` on CPU calls MKL's sgemm with the weight as stored, which at decode
batch sizes moves weights at about 8 GB/s here, a third of the machine's bandwidth.
oneDNN with the weight reordered once into its blocked layout (what Inductor's freezing
pass does) is the same fp32 arithmetic and measured, for the 30M benchmark model's
matrices on the 2-core dev machine: 2.9x faster at 4 rows, 1.8x at 64, 1.3x at 1,024
(``ops/bench/engine/cpu_ops.py``). The modules are swapped in place after loading, so the
transformers model code is unchanged. A tied LM head is packed only while the packed copy
is small (at most 64 MiB: the default model's 8192x256 head, 8 MiB; its few-row path still
reads the embedding's storage); a larger one keeps its shared weight (packing it would
duplicate a big embedding). The default model's head at 4-16 rows (a verification step):
packed 405-677 us against 656-960 us for ``F.linear``.

At a few rows it can be the other way round: oneDNN's primitive for the padded 8 rows
cost 4-5x MKL's matrix-vector product (``F.linear`` of one row) on one 2-core machine, so a
small input takes ``F.linear`` on the weight as loaded (kept beside the packed copy;
exactness: both are fp32 dot products, and greedy outputs are checked against
transformers, which runs ``F.linear``). How small depends on the CPU as much as on the
weight: on that machine ``F.linear`` won up to 32 rows for weights under 1 MiB, on the next
(AVX-512) the packed weight won from 2 rows. So the threshold (``gemv_rows``) is measured
at load for the small and the large weights (``gemv_calibration.py``); the constants
below are only the defaults of a module built outside the loader.
"""

from __future__ import annotations

import functools

import structlog
import torch
from torch import nn
from torch.nn import functional as F

_log = structlog.get_logger("ferry.worker.packed_linear")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_GEMV_ROWS = 2  # at most this many rows: F.linear (MKL) beats the packed layout
_CACHED_GEMV_ROWS = 32  # the same for a weight of at most _CACHED_BYTES
_CACHED_BYTES = 1 << 20
_TIED_PACK_BYTES = 64 << 20  # a tied LM head up to this size is packed (a second copy)


def bucket_rows(rows: int) -> int:
    """Row count rounded up to one of a few sizes: multiples of 8 up to 128, of 32 up to
    512, then of 128.

    oneDNN builds (and torch's ideep caches) one primitive per input shape. Fed every row
    count a ragged batch produces, resident memory grew by 240 MiB over 2,500 requests
    (``ops/bench/engine/memory.py``); with these ~50 sizes per weight it stays bounded, for at
    most 7 padded rows on a decode batch below 128.
    """
    if rows <= 128:
        step = 8
    elif rows <= 512:
        step = 32
    else:
        step = 128
    return max(step, -(-rows // step) * step)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W in oneDNN's packed layout (inference only, CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.weight = weight  # [out, in] as loaded: the few-row path
        small = weight.numel() * weight.element_size() <= _CACHED_BYTES
        self.gemv_rows = _CACHED_GEMV_ROWS if small else _GEMV_ROWS
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows <= self.gemv_rows:
            return F.linear(x, self.weight, self.bias)
        out = self.packed_rows(x.reshape(rows, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def packed_rows(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        """The packed path whatever the row count (``gemv_calibration`` times it)."""
        rows = flat.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:  # [rows, in] -> [padded, in], zero rows at the end
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """The private oneDNN ops exist in this torch build and agree with ``F.linear``."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = nn.Linear(16, 8).to(dtype)
        x = torch.randn(3, 16, dtype=dtype)
        with torch.inference_mode():
            return bool(torch.allclose(PackedLinear(probe)(x), probe(x), atol=1e-2))
    except (RuntimeError, AttributeError) as exc:
        _log.warning("packed_linear_unavailable", error=str(exc))
        return False


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a ``PackedLinear`` (a tied LM head
    only while small); returns how many."""
    tied = _tied_output(model)
    weight = getattr(tied, "weight", None)
    if isinstance(weight, torch.Tensor) \
            and weight.numel() * weight.element_size() <= _TIED_PACK_BYTES:
        tied = None
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and mod is not tied]
    if not targets or not packing_works(targets[0][1].weight.dtype):
        return 0
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(mod))
    return len(targets)


def _tied_output(model: nn.Module) -> nn.Module | None:
    get_out, get_in = (getattr(model, n, None) for n in
                       ("get_output_embeddings", "get_input_embeddings"))
    if get_out is None or get_in is None:
        return None
    out, emb = get_out(), get_in()
    if out is not None and emb is not None and out.weight is emb.weight:
        return out  # type: ignore[no-any-return]
    return None
