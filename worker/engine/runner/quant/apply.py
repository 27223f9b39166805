"""The loader's two calls: ``prepare`` before transformers builds the model, ``apply`` after.

``prepare`` decides the scheme and takes ``quantization_config`` off the config handed to
transformers, so transformers builds a plain float model (it would otherwise ask for
packages Ferry does not use); ``apply`` then swaps every linear layer that the scheme
covers for a quantized module, from the checkpoint's own tensors or quantized here, and
every MoE layer's SiLU-gated experts for ``QuantizedExperts`` (``experts.py``). A quantized
tensor in the checkpoint that nothing replaced takes (a layer type Ferry does not quantize)
is refused by the layer's type, so nothing is ever served from random weights.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
import torch
from torch import nn

from worker.engine.runner.moe import fused_layout, is_experts_module
from worker.engine.runner.quant.checkpoint_config import as_dict, scheme_from_checkpoint
from worker.engine.runner.quant.config import QuantizationError, QuantScheme, scheme_at_load
from worker.engine.runner.quant.expert_checkpoint import read_experts
from worker.engine.runner.quant.experts import QuantizedExperts, attach, quantize_projection
from worker.engine.runner.quant.formats import (
    QUANT_SUFFIXES,
    CheckpointTensors,
    build_layer,
    modelopt_config,
)
from worker.engine.runner.quant.fp8 import Fp8Linear, check_shape, quantize_fp8_rows
from worker.engine.runner.quant.int4 import Int4Embedding, Int4Linear, quantize_groups
from worker.engine.runner.quant.int8 import Int8Embedding, Int8Linear

_log = structlog.get_logger("ferry.worker.quant")
_ROUTER = "*.mlp.gate"  # an MoE router stays in the model's dtype (top-k is sensitive)
# int4's LM head and embedding: groups of 64 columns (the default model's bits per byte
# +0.3% over fp32 with them, against +0.06% with an int8 head; ops/bench/techniques/quant.py)
HEAD_GROUP = 64


def prepare(method: str | None, hf_config: Any, path: str) -> QuantScheme | None:
    """The scheme for this model (None: float), and ``hf_config`` without its
    ``quantization_config`` (mutated: it is the config transformers then builds from)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        raw = modelopt_config(path)
    if raw is None:
        return scheme_at_load(method) if method else None
    scheme = scheme_from_checkpoint(as_dict(raw))
    if method and method != scheme.method:
        raise QuantizationError(f"the checkpoint is already quantized ({scheme.source} "
                                f"{scheme.method}); --quantization {method} cannot apply")
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    return scheme


@contextmanager
def loading(scheme: QuantScheme | None) -> Iterator[None]:
    """Around transformers' ``from_pretrained``: a quantized checkpoint's tensors are
    unexpected keys to the float model it builds (``apply`` reads them), so its load report
    listing them is silenced."""
    if scheme is None or scheme.source == "load":
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Exact names, ``re:`` regular expressions (compressed-tensors) or globs (ModelOpt)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern) \
                or fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def apply(model: nn.Module, scheme: QuantScheme, path: str) -> int:
    """Replace the model's covered linear layers and MoE experts in place; returns how
    many modules were quantized."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and mod is not head
               and not ignored(name, scheme.ignore + (_ROUTER,))]
    moe = [(name, mod) for name, mod in model.named_modules()
           if is_experts_module(mod) and not ignored(name, scheme.ignore)]
    tensors = None if scheme.source == "load" else CheckpointTensors(path)
    if tensors is None:
        experts = {name: _quantized_experts(scheme, name, mod) for name, mod in moe
                   if fused_layout(mod)}
    else:
        experts, taken = {}, {name for name, _ in targets}
        for name, mod in moe:
            found = read_experts(scheme, name, mod, tensors) if fused_layout(mod) else None
            if found is not None:
                experts[name] = found[0]
                taken.update(found[1])
        _refuse_untaken(model, tensors, taken)
    for name, mod in targets:
        layer = _quantized(scheme, name, mod) if tensors is None else \
            build_layer(scheme, name, mod, tensors)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    for name, quantized in experts.items():
        attach(model.get_submodule(name), quantized)
    count = len(targets) + len(experts)
    if scheme.head:
        count += _quantize_head(model, scheme)
    _log.info("quantized", method=scheme.method, source=scheme.source, layers=count,
              moe_layers=len(experts), moe_layers_float=len(moe) - len(experts))
    return count


def _quantized_experts(scheme: QuantScheme, name: str, module: Any) -> QuantizedExperts:
    """``module``'s float experts quantized at load (int4: per projection, the largest group
    size among the scheme's, 64 and 32 that divides its input width)."""
    w13, w2 = module.gate_up_proj, module.down_proj  # [E, 2I, H], [E, H, I]
    projections = []
    for label, weight in (("gate_up", w13), ("down", w2)):
        group = 0
        if scheme.method == "int4":
            group = next((g for g in (scheme.group_size, 64, 32) if weight.shape[2] % g == 0), 0)
            if not group:
                raise QuantizationError(
                    f"int4: experts {name} ({label}) have {weight.shape[2]} input features, "
                    "not a multiple of a group size the kernel takes (32)")
        projections.append(quantize_projection(scheme.method, weight, group))
    return QuantizedExperts(scheme.method, projections[0], projections[1],
                            int(w13.shape[0]), int(w2.shape[2]))


def _quantized(scheme: QuantScheme, name: str, linear: nn.Linear) -> nn.Module:
    weight = linear.weight  # [N, K]
    if scheme.method == "int8":
        return Int8Linear.from_linear(linear)
    if scheme.method == "fp8":
        check_shape(name, *weight.shape)
        q, scale = quantize_fp8_rows(weight)
        return Fp8Linear(q, scale, None, linear.bias)
    group = next((g for g in (scheme.group_size, 64, 32) if weight.shape[1] % g == 0), 0)
    if not group:
        raise QuantizationError(f"int4: layer {name} has {weight.shape[1]} input features, "
                                "not a multiple of a group size the kernel takes (32)")
    q, scale, zero = quantize_groups(weight, group)
    return Int4Linear(q, scale, zero, group, linear.bias)


def _quantize_head(model: Any, scheme: QuantScheme) -> int:
    """The LM head (and the embedding: the same rows when they are tied) in int8, or in
    int4 under ``int4`` where the rows fit the CPU kernel's 64-row blocks (int8 else)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if type(head) is not nn.Linear or type(emb) is not nn.Embedding:
        return 0
    tied = head.weight is emb.weight
    n, k = head.weight.shape
    group = next((g for g in (HEAD_GROUP, 32) if k % g == 0), 0)
    if scheme.method == "int4" and group and n % 64 == 0 and emb.weight.shape[0] % 64 == 0:
        table4 = Int4Linear(*quantize_groups(head.weight, group), group, head.bias)
        emb4 = table4 if tied else Int4Linear(*quantize_groups(emb.weight, group), group, None)
        model.set_output_embeddings(table4)
        model.set_input_embeddings(Int4Embedding(emb4, emb.weight.dtype, emb.padding_idx))
        return 2
    table = Int8Linear.from_linear(head)
    emb_table = table if tied else Int8Linear(*_rows(emb.weight), None)
    model.set_output_embeddings(table)
    model.set_input_embeddings(Int8Embedding(emb_table, emb.weight.dtype, emb.padding_idx))
    return 2


def _rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from worker.engine.runner.quant.int8 import quantize_rows

    return quantize_rows(weight)


def _refuse_untaken(model: nn.Module, tensors: CheckpointTensors, taken: set[str]) -> None:
    """A quantized tensor for a module no quantized layer replaces: refused by its type."""
    modules = dict(model.named_modules())
    for key in tensors.names():
        suffix = next((s for s in QUANT_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            continue
        owner = key[: -len(suffix)]
        if owner in taken:
            continue
        mod = _owning_module(modules, owner)
        kind = type(mod).__name__ if mod is not None else "unknown module"
        raise QuantizationError(f"quantized weights of {owner} ({kind}) are not implemented: "
                                "only linear layers and SiLU-gated MoE experts load "
                                "quantized")


def _owning_module(modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name
    while name:
        if name in modules:
            return modules[name]
        name = name.rpartition(".")[0]
    return None
