"""The base model's projections an adapter may target, with their shapes.

Why a table of its own: the loader checks an adapter against it (a module the base lacks,
or of another shape, is an adapter for another model) and the slot pool allocates one
stacked buffer per entry. Module names are the causal-LM's own (``model.layers.0.
self_attn.q_proj``), which is what PEFT writes after its ``base_model.model.`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from worker.engine.distributed.sharding import ShardCut

# The projections LoRA may adapt: attention's q/k/v/o and the MLP's gate/up/down
SUPPORTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TargetShape:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BaseTargets:
    """Every adaptable projection of the base model, by module name."""

    name: str  # the served model (its path or hub id), for error messages
    shapes: dict[str, TargetShape]  # the unsharded projections' (what an adapter adapts)
    # tensor parallelism: the slice of each sharded projection this rank holds; an
    # adapter's A and B are cut the same way (``slots.py``)
    cuts: dict[str, ShardCut] = field(default_factory=dict)

    def local_shape(self, module: str) -> TargetShape:
        """``module``'s shape on this rank: its cut axis narrowed to the shard."""
        shape, cut = self.shapes[module], self.cuts.get(module)
        if cut is None:
            return shape
        if cut.axis == "out":
            return replace(shape, out_features=cut.end - cut.start)
        return replace(shape, in_features=cut.end - cut.start)


def linear_shape(module: nn.Module) -> TargetShape | None:
    """(in, out) of an ``nn.Linear`` or anything shaped like one (``PackedLinear``)."""
    fin, fout = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(fin, int) and isinstance(fout, int):
        return TargetShape(fin, fout)
    return None


def base_targets(model: nn.Module, name: str) -> BaseTargets:
    """The adaptable projections of ``model`` (a wrapped one counts as its base), at their
    unsharded shapes, with the cut of each tensor-parallel shard."""
    shapes, cuts = {}, {}
    for mod_name, module in model.named_modules():
        if mod_name.rpartition(".")[2] not in SUPPORTED:
            continue
        base = getattr(module, "base", module)
        shape = linear_shape(base)
        if shape is None:
            continue
        cut = getattr(base, "cut", None)
        if isinstance(cut, ShardCut):
            cuts[mod_name] = cut
            shape = (replace(shape, out_features=cut.full) if cut.axis == "out"
                     else replace(shape, in_features=cut.full))
        shapes[mod_name] = shape
    if not shapes:
        raise ValueError(f"{type(model).__name__} has no projection LoRA can adapt "
                         f"(none named {', '.join(SUPPORTED)})")
    return BaseTargets(name, shapes, cuts)


def check_all_cut(targets: BaseTargets) -> None:
    """Under tensor parallelism every adaptable projection must say which slice it holds
    (``ShardCut``): one that does not (a quantized shard, a layer the plan left whole)
    would take an adapter cut wrong, so LoRA is refused at start, naming it."""
    uncut = [m for m in targets.shapes if m not in targets.cuts]
    if uncut:
        raise ValueError(f"LoRA under tensor parallelism: projection {uncut[0]!r} does not "
                         f"say which slice of it this rank holds ({len(uncut)} such), so "
                         "adapters cannot be cut for it; serve LoRA on unquantized weights "
                         "of a model type the shard plan covers")
