"""Load one rank's shards of a safetensors checkpoint without the whole model in memory.

The model is built on the meta device; each module that the shard plan cuts is filled
from the (memory-mapped) checkpoint just before it is cut, so at most one full weight is
resident besides this rank's shards. Modules left whole (norms, routers, their buffers)
are filled last, and the rotary embedding, whose buffers no checkpoint holds, is rebuilt
on the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from worker.engine.distributed.shard_model import shard_model
from worker.engine.distributed.tp_config import TPConfig

# a name the model uses, to where a checkpoint may hold it instead: GPT-NeoX's head saved
# under its original name, or the embedding a tied head reuses
_ALIASES = {"lm_head.weight": ("embed_out.weight", "model.embed_tokens.weight")}
# per-expert checkpoint layouts (Mixtral's original one, Qwen-MoE's): gate, up, down
_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
_EXPERT_LEAVES = ("gate_up_proj", "down_proj")  # a fused experts module's weights


class _Checkpoint:
    """Tensor names to their safetensors file, read one tensor at a time."""

    def __init__(self, path: Path) -> None:
        self.files: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        for file in sorted(path.glob("*.safetensors")):
            handle = safe_open(str(file), framework="pt")
            self.files[str(file)] = handle
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                self.where[key] = str(file)
        if not self.where:
            raise FileNotFoundError(f"no .safetensors files under {path}")

    def get(self, name: str) -> torch.Tensor:
        key = name if name in self.where else next(
            (alias for alias in _ALIASES.get(name, ()) if alias in self.where), name)
        if key not in self.where and ".mlp." in name:  # Mixtral's block_sparse_moe
            key = name.replace(".mlp.", ".block_sparse_moe.")
        if key in self.where:
            return self.files[self.where[key]].get_tensor(key)
        fused = self._per_expert(name)
        if fused is None:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return fused

    def _per_expert(self, name: str) -> torch.Tensor | None:
        """A fused experts weight (``gate_up_proj`` [E, 2I, H]: gate rows, then up rows;
        ``down_proj`` [E, H, I]) stacked from a checkpoint that stores each expert."""
        parent, _, leaf = name.rpartition(".experts.")
        if leaf not in ("gate_up_proj", "down_proj"):
            return None
        for where in (parent, parent.rpartition(".")[0] + ".block_sparse_moe"):
            for gate, up, down in _EXPERT_NAMES:
                count = 0
                while f"{where}.experts.{count}.{gate}.weight" in self.where:
                    count += 1
                if not count:
                    continue
                def one(e: int, proj: str, where: str = where) -> torch.Tensor:
                    return self.get(f"{where}.experts.{e}.{proj}.weight")
                if leaf == "down_proj":
                    return torch.stack([one(e, down) for e in range(count)])
                return torch.stack([torch.cat([one(e, gate), one(e, up)])
                                    for e in range(count)])
        return None


def _filler(ckpt: _Checkpoint, names: dict[int, str], dtype: torch.dtype,
            keep_meta: frozenset[str]) -> Any:
    def fill(module: nn.Module) -> None:
        prefix = names[id(module)]
        for local, param in list(module.named_parameters(recurse=True)):
            key = f"{prefix}.{local}"
            owner_name, _, leaf = key.rpartition(".")
            if param.device.type != "meta" or (leaf == "weight" and owner_name in keep_meta) \
                    or (leaf in _EXPERT_LEAVES and owner_name.removesuffix(".inner") in keep_meta):
                continue
            owner = module.get_submodule(local.rpartition(".")[0]) if "." in local else module
            full = ckpt.get(key).to(dtype)
            setattr(owner, local.rpartition(".")[2], nn.Parameter(full, requires_grad=False))
    return fill


def load_sharded(path: str | Path, tp: TPConfig, dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "eager",
                 keep_meta: frozenset[str] = frozenset()) -> Any:
    """Rank ``tp.rank``'s model from a local safetensors checkpoint (dense families).

    The weights of the modules named in ``keep_meta`` (a quantized checkpoint's layers, and
    experts modules whose experts it holds quantized) stay on the meta device, cut there
    like the others: the caller swaps those layers for quantized ones read from their
    packed tensors (``quant/tp_checkpoint.py``)."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    ckpt = _Checkpoint(path)
    names = {id(m): name for name, m in model.named_modules()}
    fill = _filler(ckpt, names, dtype, keep_meta)
    shard_model(model, tp, materialise=fill)
    for name, module in list(model.named_modules()):
        names[id(module)] = name
        if name.endswith("rotary_emb"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(module)(config=config))
        elif any(p.device.type == "meta" for p in module.parameters(recurse=False)):
            _filler(ckpt, names, dtype, keep_meta)(module)
        if not name.endswith("rotary_emb"):
            _fill_buffers(ckpt, name, module)
    return model.eval()


def _fill_buffers(ckpt: _Checkpoint, prefix: str, module: nn.Module) -> None:
    """The module's own buffers still on the meta device (a router's persistent score
    bias, DeepSeek-V3's ``e_score_correction_bias``) from the checkpoint, dtype kept."""
    for local, buffer in list(module.named_buffers(recurse=False)):
        if buffer is not None and buffer.device.type == "meta":
            full = ckpt.get(f"{prefix}.{local}" if prefix else local).to(buffer.dtype)
            setattr(module, local, full)
