"""Refuse at load what Ferry would serve wrongly, naming the feature and the model.

Loading through transformers' ``AttentionInterface`` makes almost every architecture
*run*; it does not make it *right*. Three checks stand between a checkpoint and traffic:

* **The config** (``check_config``, before the weights load): multi-head latent attention
  in a config class whose modules Ferry's MLA path has not been proven on
  (``mla.SERVED_MLA_CONFIGS``), and any ``quantization_config`` whose ``quant_method`` is not in
  ``SUPPORTED_QUANT_METHODS`` (an unknown method is named as such: transformers would
  load it silently unquantized).
* **The weights' headers** (``check_weights``): fp8 tensors without their scales (a
  config that lost its quantization section loads them as garbage).
* **The attention calls** (``probe_attention``, after loading): one forward of a few
  tokens through a recording backend. Every layer must call the attention function once,
  with the cache's head sizes, no mask tensor, and only keyword arguments Ferry
  implements (``interface.check_kwargs``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from worker.engine.runner.attention.interface import UnsupportedAttention
from worker.engine.runner.attention.layer_features import model_body, text_config
from worker.engine.runner.attention.metadata import AttentionMetadata, ForwardContext
from worker.engine.runner.attention.mla import SERVED_MLA_CONFIGS, is_mla
from worker.engine.runner.quant.config import SUPPORTED_CHECKPOINT_METHODS

# The checkpoint formats Ferry serves (``quantization_config.quant_method``) are the quant
# package's: every other one is refused here by name.
SUPPORTED_QUANT_METHODS = SUPPORTED_CHECKPOINT_METHODS
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FN", "F8_E5M2FNUZ", "F8_E4M3FNUZ")
_SCALE_SUFFIXES = ("_scale", "_scale_inv", "_scales")


class UnservableModel(ValueError):
    """A checkpoint asks for something Ferry does not implement."""

    def __init__(self, model: str, feature: str, detail: str) -> None:
        super().__init__(f"model {model!r} cannot be served: {feature} is not implemented "
                         f"by Ferry ({detail})")
        self.feature = feature


def known_quant_methods() -> frozenset[str]:
    """Every ``quant_method`` transformers knows."""
    from transformers.utils.quantization_config import QuantizationMethod

    return frozenset(m.value for m in QuantizationMethod)


def check_config(hf_config: Any, model: str) -> None:
    """Refuse MLA and unsupported quantization from the config alone."""
    cfg = text_config(hf_config)
    if is_mla(cfg) and type(cfg).__name__ not in SERVED_MLA_CONFIGS:
        raise UnservableModel(model, "multi-head latent attention (MLA)",
                              f"{type(cfg).__name__}: MLA is served for "
                              f"{', '.join(sorted(SERVED_MLA_CONFIGS))} only")
    for owner in (hf_config, cfg):
        quant = getattr(owner, "quantization_config", None)
        if quant is not None:
            _check_quant(quant, model)
            return


def _check_quant(quant: Any, model: str) -> None:
    method = quant.get("quant_method") if isinstance(quant, dict) else \
        getattr(quant, "quant_method", None)
    method = getattr(method, "value", method)  # a QuantizationMethod enum
    if not isinstance(method, str) or (method not in known_quant_methods()
                                       and method not in SUPPORTED_QUANT_METHODS):
        raise UnservableModel(model, f"unknown quant_method {method!r}",
                              "quantization_config names a method transformers does not "
                              "know; loading it would silently drop the quantization")
    if method not in SUPPORTED_QUANT_METHODS:
        supported = ", ".join(sorted(SUPPORTED_QUANT_METHODS)) or "none yet"
        raise UnservableModel(model, f"quantization ({method})",
                              f"quant_method {method!r}; supported: {supported}")


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 1 << 30:
            raise ValueError(f"{path.name}: a {size}-byte safetensors header")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header  # type: ignore[no-any-return]


def check_weights(path: str, model: str) -> None:
    """Refuse fp8 tensors that have no scale tensor beside them (local checkpoints)."""
    root = Path(path)
    if not root.is_dir():
        return
    dtypes: dict[str, str] = {}
    for file in sorted(root.glob("*.safetensors")):
        try:
            dtypes.update({k: v.get("dtype", "") for k, v in _safetensors_header(file).items()})
        except (OSError, ValueError, struct.error) as exc:
            raise ValueError(f"model {model!r}: cannot read {file.name}: {exc}") from exc
    for name, dtype in dtypes.items():
        if dtype.upper() in _FP8_DTYPES and not any(
                name + suffix in dtypes for suffix in _SCALE_SUFFIXES):
            raise UnservableModel(model, "fp8 weights without scales",
                                  f"{name} is {dtype} and the checkpoint has no "
                                  f"{name}_scale or {name}_scale_inv")


class _ProbeBackend:
    """Records each attention call's q/k/v shapes; attends to nothing (returns zeros)."""

    name = "probe"

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], ...]] = []

    def forward(self, q, k, v, cache, meta, scale, sliding_window, soft_cap,  # type: ignore[no-untyped-def]
                sinks=None, chunk=None):
        self.calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return q.new_zeros(*q.shape[:2], v.shape[2])  # [T, Hq, Dv]


def probe_attention(model: Any, model_name: str, shape: Any, device: torch.device) -> None:
    """One 3-token forward through a recording backend: each layer must call attention
    once with the cache's head sizes and nothing Ferry does not implement."""
    n = 3
    dev = device
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev), num_decodes=0,
        max_decode_seq_len=0, decode_buckets=[], max_query_len=n, max_seq_len=n,
        query_start_host=[0, n], seq_lens_host=[n])
    backend = _ProbeBackend()
    empty = torch.empty(0, device=dev)
    positions = torch.arange(n, device=dev)
    ctx = ForwardContext(meta=meta, kv_caches=[(empty, empty)] * (shape.num_layers + 64),
                         backend=backend, positions=positions)
    with torch.inference_mode():
        try:
            model_body(model)(input_ids=torch.zeros(1, n, dtype=torch.long, device=dev),
                              position_ids=positions[None], use_cache=False, ferry_ctx=ctx)
        except UnsupportedAttention as exc:
            raise UnservableModel(model_name, "an attention feature", str(exc)) from exc
        except Exception as exc:
            raise UnservableModel(model_name, "this architecture's forward",
                                  f"a probe forward failed: {type(exc).__name__}: "
                                  f"{exc}") from exc
    _check_calls(backend.calls, model_name, shape)


def _check_calls(calls: list[tuple[tuple[int, ...], ...]], model: str, shape: Any) -> None:
    """``shape``: the ``ModelShape`` the cache is built for (``model_loader``, which
    imports this module)."""
    num_layers, num_kv_heads, head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
    if len(calls) != num_layers:
        raise UnservableModel(model, "attention layers that share or skip the KV cache",
                              f"{len(calls)} attention calls per forward for "
                              f"{num_layers} layers")
    for q, k, v in calls:  # [T, H, D] each
        if not (q[2] == k[2] == head_dim and v[2] == shape.value_dim):
            raise UnservableModel(model, "these query, key and value head sizes",
                                  f"q/k/v head sizes {q[2]}/{k[2]}/{v[2]}, cache "
                                  f"{head_dim}/{head_dim}/{shape.value_dim}")
        if k[1] != num_kv_heads or v[1] != num_kv_heads or q[1] % num_kv_heads:
            raise UnservableModel(model, "this layout of attention heads",
                                  f"{q[1]} query heads over {k[1]} key heads, cache "
                                  f"{num_kv_heads}")
