"""A quantized checkpoint's tensors for one linear layer, turned into a quantized module.

Layouts (per layer ``name``; N output features, K input features, g the group size):
compressed-tensors and ModelOpt FP8: ``weight`` float8_e4m3fn [N, K], ``weight_scale``
([] / [1] per tensor, [N, 1] per channel), ``input_scale`` (static activations).
compressed-tensors INT8: ``weight`` int8 [N, K], ``weight_scale`` [N, 1].
AWQ (gemm): ``qweight`` int32 [K, N/8] (eight 4-bit columns per word, in AWQ's
interleaved order), ``qzeros`` int32 [K/g, N/8] (the same packing), ``scales`` [K/g, N].
GPTQ: ``qweight`` int32 [K/8, N] (eight rows per word), ``qzeros`` int32 [K/g, N/8]
(stored minus one in the original format), ``scales`` [K/g, N], ``g_idx`` [K].
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from worker.engine.runner.quant.config import QuantizationError, QuantScheme
from worker.engine.runner.quant.fp8 import Fp8Linear, check_shape
from worker.engine.runner.quant.int4 import Int4Linear
from worker.engine.runner.quant.int8 import Int8Linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column j of a word sits in nibble AWQ_ORDER.index(j)
QUANT_SUFFIXES = (".qweight", ".weight_scale", ".weight_packed", ".qzeros")


class TensorSource(Protocol):
    """Where a layer's tensors are read from: the whole checkpoint, or one rank's cut of it
    (``tp_checkpoint.py``)."""

    def get(self, key: str) -> torch.Tensor | None: ...

    def need(self, key: str) -> torch.Tensor: ...


class CheckpointTensors:
    """Lazy access to every tensor of a local safetensors checkpoint, by name."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        if not os.path.isdir(path):
            raise QuantizationError(f"a quantized checkpoint must be a local directory: {path}")
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise QuantizationError(f"no .safetensors files in {path}")
        self._handles = [safe_open(os.path.join(path, f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}  # noqa: SIM118 (a safetensors handle)

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def has(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor | None:
        handle = self._where.get(key)
        return None if handle is None else handle.get_tensor(key).clone()  # off the mmap

    def need(self, key: str) -> torch.Tensor:
        value = self.get(key)
        if value is None:
            raise QuantizationError(f"the checkpoint has no tensor {key}")
        return value

    def part(self, key: str, dim: int, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``key`` along ``dim``, read without the rest."""
        handle = self._where.get(key)
        if handle is None:
            raise QuantizationError(f"the checkpoint has no tensor {key}")
        view = handle.get_slice(key)
        index = [slice(None)] * len(view.get_shape())
        index[dim] = slice(start, end)
        return view[tuple(index)]


def modelopt_config(path: str) -> dict[str, Any] | None:
    """ModelOpt's ``hf_quant_config.json`` beside the weights, as a quantization_config."""
    file = os.path.join(path, "hf_quant_config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as fh:
        return {"quant_method": "modelopt", **json.load(fh)}


def unpack_int4(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values in nibble order, expanded along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 1:
        return nib.reshape(words.shape[0], -1)
    return nib.permute(0, 2, 1).reshape(-1, words.shape[1])


def _awq_columns(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N]
    nib = unpack_int4(words, 1).view(words.shape[0], -1, 8)
    order = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
    return nib[..., order].reshape(words.shape[0], -1)


def build_layer(scheme: QuantScheme, name: str, linear: nn.Module,
                tensors: CheckpointTensors) -> nn.Module:
    """The quantized module for layer ``name`` from its checkpoint tensors, on the device of
    the layer it replaces (int4's packing depends on it: the CPU kernel's or the CUDA one)."""
    bias = getattr(linear, "bias", None)
    device = next(iter(linear.parameters())).device
    layer = _layer(scheme, name, bias, tensors, device)
    return layer if isinstance(layer, Int4Linear) else layer.to(device)


def _layer(scheme: QuantScheme, name: str, bias: torch.Tensor | None,
           tensors: CheckpointTensors, device: torch.device) -> nn.Module:
    if scheme.method == "int4":
        q, scale, zero = read_int4(scheme, name, tensors)
        return Int4Linear(q.to(device), scale.to(device), zero.to(device), scheme.group_size,
                          bias)
    weight, scale, input_scale = read_scaled(scheme, name, tensors)
    if scheme.method == "int8":
        return Int8Linear(weight, scale.reshape(-1), bias)
    check_shape(name, *weight.shape)
    return Fp8Linear(weight, scale, input_scale, bias)


def read_int4(scheme: QuantScheme, name: str, tensors: TensorSource,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ or GPTQ tensors of layer ``name`` as (q [N, K] in 0..15, scale [N, K/g] fp32,
    zero [N, K/g]): weight = (q - zero) * scale."""
    if scheme.source == "awq":
        q = _awq_columns(tensors.need(f"{name}.qweight")).t()  # [N, K]
        zero = _awq_columns(tensors.need(f"{name}.qzeros")).t()  # [N, K/g]
    else:
        q = unpack_int4(tensors.need(f"{name}.qweight"), 0).t()  # [N, K]
        zero = unpack_int4(tensors.need(f"{name}.qzeros"), 1).t()  # [N, K/g]
        if scheme.checkpoint_format == "gptq":
            zero = zero + 1
        _check_g_idx(name, tensors.get(f"{name}.g_idx"), q.shape[1], scheme.group_size)
    scale = tensors.need(f"{name}.scales").float().t()
    n, k = q.shape
    group = scheme.group_size
    if k % group or scale.shape != (n, k // group) or zero.shape != scale.shape:
        raise QuantizationError(f"{name}: int4 tensors of shapes q {tuple(q.shape)}, scales "
                                f"{tuple(scale.shape)}, zeros {tuple(zero.shape)} do not fit "
                                f"group size {group}")
    return q, scale, zero.float()


def read_scaled(scheme: QuantScheme, name: str, tensors: TensorSource,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FP8 or INT8 tensors of layer ``name`` as (weight [N, K] float8_e4m3fn / int8,
    fp32 scale [] / [1] per tensor or [N, 1] per channel, static input scale or None)."""
    weight = tensors.need(f"{name}.weight")
    scale = tensors.need(f"{name}.weight_scale").float()
    if scheme.method == "int8":
        if weight.dtype != torch.int8:
            raise QuantizationError(f"{name}.weight is {weight.dtype}, expected int8")
        return weight, scale, None
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantizationError(f"{name}.weight is {weight.dtype}; fp8 checkpoints hold "
                                "float8_e4m3fn weights")
    input_scale = tensors.get(f"{name}.input_scale")
    if scheme.activations == "static_tensor" and input_scale is None:
        raise QuantizationError(f"static activation scales: the checkpoint has no "
                                f"{name}.input_scale")
    return weight, scale, input_scale if scheme.activations == "static_tensor" else None


def _check_g_idx(name: str, g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if g_idx is None:
        return
    if not torch.equal(g_idx.to(torch.long), torch.arange(k) // group):
        raise QuantizationError(f"{name}: GPTQ g_idx is not in order (activation-order "
                                "groups, desc_act) which is not implemented")
