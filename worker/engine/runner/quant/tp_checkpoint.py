"""A quantized checkpoint under tensor parallelism: each rank reads only its cut of every
packed tensor (never a whole layer) into the layers one process builds, by ``ShardCut``.

- Column-parallel layers (q/k/v by heads, gate/up) keep output rows ``[s, e)``: FP8/INT8
  ``weight`` [N, K] rows, a per-channel ``weight_scale`` [N, 1] rows (a per-tensor one
  whole); AWQ ``qweight`` [K, N/8] words ``[s/8, e/8)`` (eight output columns a word),
  GPTQ ``qweight`` [K/8, N] columns ``[s, e)``; both ``qzeros`` [K/g, N/8] words and
  ``scales`` [K/g, N] columns likewise. A cut off a word's boundary is refused by name.
- Row-parallel layers (o, down) keep input columns ``[s, e)``: FP8/INT8 ``weight``
  columns, every scale whole (per tensor or per output channel); AWQ ``qweight`` rows
  ``[s, e)``, GPTQ ``qweight`` words ``[s/8, e/8)``, ``qzeros`` and ``scales`` groups
  ``[s/g, e/g)``, GPTQ ``g_idx`` ``[s, e)`` rebased to the shard's first group. A group
  size that does not divide the shard is refused naming the layer, group and widths; an
  out-of-order ``g_idx`` (activation order) is refused as in one process. The shard's
  partial outputs are summed by ``tp_shard.ReducedQuant`` (fp32 partials, one bf16 rounding
  after the all-reduce where one process's kernel rounds) and FP8's dynamic per-token
  activation scale is the maximum over the ranks (``tp_shard.CutFp8Linear``).

MoE experts stored per expert (``experts.{e}.w1/w3/w2`` or ``gate_proj/up_proj/
down_proj``), FP8 or INT8: a rank reads the rows ``[s, e)`` of its intermediate slice from
every expert's gate and up layers and those input columns from its down layer, by the
same cuts, into the ``QuantizedExperts`` one process builds (``expert_checkpoint.py``);
the experts' all-reduce sums the partials. INT4 experts (AWQ, GPTQ) are refused by name:
their kernel rounds each expert's output to bf16, which a partial cannot reproduce.
"""

from __future__ import annotations

import structlog
import torch
from torch import nn

from worker.engine.distributed.layers import ColumnParallelLinear, RowParallelLinear
from worker.engine.distributed.shard_model import HeadLinear
from worker.engine.distributed.sharding import ShardCut, even_range
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.runner.moe import is_experts_module
from worker.engine.runner.quant.apply import ignored
from worker.engine.runner.quant.config import QuantizationError, QuantScheme
from worker.engine.runner.quant.expert_checkpoint import read_experts
from worker.engine.runner.quant.experts import attach
from worker.engine.runner.quant.formats import (
    QUANT_SUFFIXES,
    CheckpointTensors,
    read_int4,
    read_scaled,
)
from worker.engine.runner.quant.fp8 import Fp8Linear, check_shape
from worker.engine.runner.quant.int4 import Int4Linear
from worker.engine.runner.quant.int8 import Int8Linear
from worker.engine.runner.quant.tp_shard import CutFp8Linear, ReducedQuant

_log = structlog.get_logger("ferry.worker.quant")
_ROUTER = "*.mlp.gate"  # an MoE router stays in the model's dtype, as in one process
_WORD = 8  # 4-bit values per int32 word


def quantized_owners(path: str, size: int) -> frozenset[str]:
    """The modules whose quantized tensors the checkpoint at ``path`` holds: its linear
    layers, and for quantized per-expert layers also the model's experts module they fill
    (``model.layers.N.mlp.experts``, whose fused weights then stay on the meta device)."""
    tensors = CheckpointTensors(path)
    owners = set()
    for key in tensors.names():
        suffix = next((s for s in QUANT_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            continue
        owner = key[: -len(suffix)]
        owners.add(owner)
        if ".experts." in owner:
            module = owner.rpartition(".experts.")[0].replace(".block_sparse_moe", ".mlp")
            owners.add(module + ".experts")
    return frozenset(owners)


class _ExpertCuts:
    """Every expert's layers as one rank holds them: gate and up rows ``[s, e)`` of the
    intermediate size, down's input columns ``[s, e)``."""

    def __init__(self, tensors: CheckpointTensors, scheme: QuantScheme, full: int,
                 rank: int, size: int) -> None:
        start, end = even_range(full, rank, size)
        self.tensors, self.scheme = tensors, scheme
        self.rows, self.cols = ShardCut("out", start, end, full), ShardCut("in", start, end, full)

    def _layer(self, key: str) -> _CutTensors:
        layer = key.rpartition(".")[0]
        down = layer.rpartition(".")[2] in ("w2", "down_proj")
        return _CutTensors(self.tensors, self.scheme, layer, self.cols if down else self.rows)

    def has(self, key: str) -> bool:
        return self.tensors.has(key)

    def get(self, key: str) -> torch.Tensor | None:
        return self._layer(key).get(key)

    def need(self, key: str) -> torch.Tensor:
        return self._layer(key).need(key)


def _apply_experts(model: nn.Module, scheme: QuantScheme, tp: TPConfig,
                   tensors: CheckpointTensors, owners: frozenset[str],
                   device: torch.device) -> set[str]:
    """Quantized experts from the rank's cut of each expert's layers; the names taken."""
    done: set[str] = set()
    for name, mod in list(model.named_modules()):
        base = name.removesuffix(".inner")  # the experts inside their reduced wrapper
        if base not in owners or not is_experts_module(mod) or base in done:
            continue
        if scheme.method == "int4":
            raise QuantizationError(
                f"{scheme.source} int4 MoE experts ({base}) are not implemented with "
                f"tensor-parallel size {tp.size}: serve them at size 1")
        full = int(mod.down_proj.shape[-1]) * tp.size  # [E, H, I / size]
        cuts = _ExpertCuts(tensors, scheme, full, tp.rank, tp.size)
        found = read_experts(scheme, base, mod, cuts, device)
        if found is None:
            raise QuantizationError(f"{base}: the checkpoint's quantized experts were not "
                                    "found in a layout Ferry reads")
        attach(mod, found[0])
        done.update(found[1], {base})
    return done


class _CutTensors:
    """Layer ``name``'s checkpoint tensors as one rank holds them: the part of each that
    its ``cut`` keeps (``None``: the whole layer), read without the rest."""

    def __init__(self, tensors: CheckpointTensors, scheme: QuantScheme, name: str,
                 cut: ShardCut | None) -> None:
        self.tensors, self.scheme, self.name, self.cut = tensors, scheme, name, cut

    def need(self, key: str) -> torch.Tensor:
        value = self.get(key)
        if value is None:
            raise QuantizationError(f"the checkpoint has no tensor {key}")
        return value

    def get(self, key: str) -> torch.Tensor | None:
        cut, tensors = self.cut, self.tensors
        if cut is None or not tensors.has(key):
            return tensors.get(key)
        suffix = key.rpartition(".")[2]
        if suffix in ("weight_scale", "input_scale", "g_idx"):  # small: read whole, cut here
            whole = tensors.need(key)
            if suffix == "weight_scale" and cut.axis == "out" and whole.numel() > 1:
                return whole[cut.start:cut.end]  # [N', 1] per channel
            if suffix == "g_idx" and cut.axis == "in":
                return whole[cut.start:cut.end] - cut.start // self.scheme.group_size
            return whole
        dim, start, end = self._span(suffix, cut)
        return tensors.part(key, dim, start, end)

    def _span(self, suffix: str, cut: ShardCut) -> tuple[int, int, int]:
        """(dim, start, end) of this rank's part of packed tensor ``suffix``."""
        s, e, g = cut.start, cut.end, self.scheme.group_size
        out = cut.axis == "out"
        if suffix == "weight":  # [N, K]
            return (0, s, e) if out else (1, s, e)
        if suffix == "qweight" and self.scheme.source == "awq":  # [K, N/8]
            return (1, s // _WORD, e // _WORD) if out else (0, s, e)
        if suffix == "qweight":  # GPTQ [K/8, N]
            return (1, s, e) if out else (0, s // _WORD, e // _WORD)
        if suffix == "qzeros":  # [K/g, N/8]
            return (1, s // _WORD, e // _WORD) if out else (0, s // g, e // g)
        if suffix == "scales":  # [K/g, N]
            return (1, s, e) if out else (0, s // g, e // g)
        raise QuantizationError(f"{self.name}: checkpoint tensor {suffix!r} has no "
                                "tensor-parallel cut")


def _check_int4_cut(name: str, scheme: QuantScheme, cut: ShardCut) -> None:
    width, group = cut.end - cut.start, scheme.group_size
    if cut.axis == "in" and (width % group or cut.start % group):
        raise QuantizationError(
            f"int4 under tensor parallelism: layer {name}'s group size {group} does not "
            f"divide its row-parallel shard of {width} input features (of {cut.full})")
    if cut.axis == "out" and (width % _WORD or cut.start % _WORD):
        raise QuantizationError(
            f"int4 under tensor parallelism: layer {name}'s column-parallel shard of "
            f"{width} output features (from {cut.start}, of {cut.full}) does not fall on "
            f"the packed words of {_WORD} columns its zero points are stored in")


def _layer(scheme: QuantScheme, name: str, source: _CutTensors, row_cut: bool,
           bias: torch.Tensor | None, device: torch.device) -> nn.Module:
    """One process's ``formats._layer`` on the rank's part (bias: None on a row cut)."""
    bias = None if bias is None else bias.detach().to(device)
    if scheme.method == "int4":
        if source.cut is not None:
            _check_int4_cut(name, scheme, source.cut)
        q, scale, zero = read_int4(scheme, name, source)
        return Int4Linear(q.to(device), scale.to(device), zero.to(device), scheme.group_size,
                          bias)
    weight, scale, input_scale = read_scaled(scheme, name, source)
    if scheme.method == "int8":
        return Int8Linear(weight, scale.reshape(-1), bias).to(device)
    check_shape(name, *weight.shape)
    cls = CutFp8Linear if row_cut and input_scale is None else Fp8Linear
    return cls(weight, scale, input_scale, bias).to(device)


def apply_checkpoint_sharded(model: nn.Module, scheme: QuantScheme, tp: TPConfig, path: str,
                             owners: frozenset[str], device: torch.device) -> int:
    """Swap rank ``tp.rank``'s sharded linears (their weights left on the meta device by
    ``load_sharded``) for quantized layers from their cut of the checkpoint; returns how
    many. The layers are those one process quantizes: not the head, an ignored layer or an
    MoE router; a quantized tensor no such layer takes is refused by its module's name."""
    tensors = CheckpointTensors(path)
    head = model.get_output_embeddings()  # type: ignore[operator]
    done = _apply_experts(model, scheme, tp, tensors, owners, device)
    for name, mod in list(model.named_modules()):
        if mod is head or ignored(name, scheme.ignore + (_ROUTER,)):
            continue
        layer: nn.Module
        if isinstance(mod, RowParallelLinear):
            source = _CutTensors(tensors, scheme, name, mod.cut)
            layer = ReducedQuant(_layer(scheme, name, source, True, None, device), mod.bias)
        elif isinstance(mod, (ColumnParallelLinear, HeadLinear)) or type(mod) is nn.Linear:
            source = _CutTensors(tensors, scheme, name, getattr(mod, "cut", None))
            layer = _layer(scheme, name, source, False, mod.bias, device)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        done.add(name)
    modules = dict(model.named_modules())
    for owner in sorted(owners - done):
        kind = type(modules[owner]).__name__ if owner in modules else "unknown module"
        raise QuantizationError(f"quantized weights of {owner} ({kind}) are not implemented "
                                f"with tensor-parallel size {tp.size}: only the sharded "
                                "linear layers load quantized")
    _log.info("quantized", method=scheme.method, source=scheme.source, layers=len(done),
              tensor_parallel_rank=tp.rank)
    return len(done)
