"""Per-layer scales of an FP8 KV cache: read from the checkpoint, applied around attention.

An FP8 (e4m3) cache holds values up to 448 with 3 mantissa bits; a layer whose keys or
values run past that range saturates. Checkpoints prepared for an FP8 KV cache (the
compressed-tensors and ModelOpt formats, as vLLM reads them) carry one scalar per layer,
``model.layers.{i}.self_attn.k_scale`` and ``.v_scale``: the cache stores ``K / k_scale``
and ``V / v_scale``. Without them the scale is 1 (vLLM's default too).

The scales are folded around the cache, not into the kernels: scores of queries
``q * k_scale`` over keys ``K / k_scale`` are the scores of ``q`` over ``K``, and the
output over ``V / v_scale`` times ``v_scale`` is the output over ``V``. So every attention
path (Triton, the C++ kernel, torch) reads the cache as it is, and a fresh prompt's
unquantized K/V, which some paths attend to directly, cancel the same way.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

KV_SCALE_ATTR = "ferry_kv_scale"  # (k_scale, v_scale) on each attention module
_KEY = re.compile(r".*layers\.(\d+)\.self_attn\.([kv])_scale")


def read_kv_scales(path: str, num_layers: int) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) from a local checkpoint's safetensors, or None when
    it has none. A partial set, a non-scalar or a non-positive scale is refused by name."""
    from safetensors import safe_open

    folder = Path(path)
    found: dict[tuple[int, str], float] = {}
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                match = _KEY.fullmatch(key)
                if match is None:
                    continue
                tensor = handle.get_tensor(key)
                if tensor.numel() != 1:
                    raise ValueError(f"KV cache scale {key} has shape {tuple(tensor.shape)}: "
                                     "only per-layer (scalar) scales are implemented")
                value = float(tensor.float().reshape(()))
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"KV cache scale {key} must be finite and > 0, got {value}")
                found[(int(match[1]), match[2])] = value
    if not found:
        return None
    missing = [f"layer {i} {kind}_scale" for i in range(num_layers) for kind in "kv"
               if (i, kind) not in found]
    if missing:
        raise ValueError(f"the checkpoint's KV cache scales are incomplete: no {missing[0]}")
    return [(found[(i, "k")], found[(i, "v")]) for i in range(num_layers)]


def attach_kv_scales(model: Any, scales: list[tuple[float, float]]) -> int:
    """Give every attention module its layer's scales; returns how many got one."""
    count = 0
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and type(module).__name__.endswith("Attention"):
            setattr(module, KV_SCALE_ATTR, scales[layer])
            count += 1
    return count


def scale_qkv(
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
    """(q * k_scale, K / k_scale, V / v_scale, v_scale) for a scaled layer, else as given
    with None: multiply the attention output by the returned v_scale."""
    scale = getattr(module, KV_SCALE_ATTR, None)
    if scale is None:
        return q, k, v, None
    k_scale, v_scale = scale
    return q * k_scale, k / k_scale, v / v_scale, v_scale


def use_checkpoint_kv_scales(model: Any, path: str, num_layers: int,
                             kv_dtype: torch.dtype) -> bool:
    """For an FP8 cache, attach the checkpoint's per-layer scales if it has them; True when
    it did (the lean decode path, which attends outside the modules, then steps aside)."""
    if kv_dtype != torch.float8_e4m3fn:
        return False
    scales = read_kv_scales(path, num_layers)
    return scales is not None and attach_kv_scales(model, scales) > 0
