"""Load one PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Everything an adapter can get wrong is found here, at load, with a ``LoraError`` that
names the problem and the tensor, never a server path: a missing or corrupt file, a
rank over the limit, an ``lora_alpha`` that is no sane number, a target this engine
cannot adapt, weights shaped for another base model, weights of a dtype that is not a
float, or weights that are not finite (a NaN or an Inf would reach every output of the
rows on the adapter). The shapes and dtypes are checked from the weights file's header,
before any tensor is read (``adapter_files.py``). The shapes are the authority on
"another base model": ``base_model_name_or_path`` is often a hub id while the worker
serves a local copy of the same weights, so a differing name alone only goes into the
message of a shape error (vLLM does not compare it either).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.engine.lora.adapter_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Header,
    LoraError,
    check_dir,
    read_config,
    read_weights,
    refuse,
)
from worker.engine.lora.targets import SUPPORTED, BaseTargets

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "LoraAdapter", "LoraError", "all_finite",
           "load_adapter"]

# PEFT's saved key: base_model.model.<module>.lora_A.weight (an adapter-name segment
# before ``.weight`` appears in some versions' files)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# Features of the PEFT format this engine does not run: refused rather than ignored
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights"}
# The weights' dtypes (safetensors' names): what a slot holds exactly once widened
_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
MAX_ALPHA = 65536.0  # PEFT's lora_alpha is a small multiple of r (r <= 512)


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host: per module A [r, in] and B [out, r]."""

    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A, B)
    # the prefix cache's key for this adapter: name, path and registration number
    # (AdapterCache), so a name registered again with other weights never reuses KV
    cache_key: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, base: BaseTargets, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at ``path`` against ``base``; raises ``LoraError``."""
    root = Path(path)
    check_dir(name, root)
    cfg = read_config(name, root)
    _check_config(name, cfg)
    rank, scale = _rank_and_scale(name, cfg, max_rank)
    pairs: dict[str, tuple[str, str]] = {}

    def check(header: Header) -> None:  # before any tensor is read
        pairs.update(_pair_keys(name, header))
        _check_targets(name, cfg, pairs, base)
        for module, (key_a, key_b) in pairs.items():
            _check_shapes(name, cfg, module, header[key_a][1], header[key_b][1], rank, base)

    tensors = read_weights(name, root, check)
    for key, tensor in tensors.items():
        if not all_finite(tensor):
            raise refuse(name, f"{_quote(key)} holds values that are not finite (NaN or Inf)")
    weights = {module: (tensors[key_a], tensors[key_b])
               for module, (key_a, key_b) in pairs.items()}
    return LoraAdapter(name, str(root), rank, scale, weights)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite. A NaN or an Inf anywhere makes the sum non-finite,
    so a finite sum answers at once (~20x faster than ``isfinite(...).all()`` on a CPU);
    only a non-finite one, which finite values can give by overflowing, takes the exact
    test."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _check_config(name: str, cfg: dict[str, Any]) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise refuse(name, f"peft_type {_quote(peft_type)} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise refuse(name, f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise refuse(name, f"bias={_quote(repr(cfg['bias']))} is not supported (only "
                           "bias='none')")
    if cfg.get("modules_to_save"):
        raise refuse(name, f"modules_to_save {_quote(cfg['modules_to_save'])} (fully "
                           "trained modules) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise refuse(name, f"a per-module {key} is not supported")


def _rank_and_scale(name: str, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(name, f"r must be a positive integer, got {_quote(rank)}")
    if rank > max_rank:
        raise refuse(name, f"rank {_quote(rank)} is over this worker's limit "
                           f"max_lora_rank={max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(name, f"lora_alpha must be a number, got {_quote(alpha)}")
    if not 0 < alpha <= MAX_ALPHA:  # also NaN; an int too large for a float is refused too
        raise refuse(name, f"lora_alpha must be in (0, {MAX_ALPHA:g}], got {_quote(alpha)}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _pair_keys(name: str, header: Header) -> dict[str, tuple[str, str]]:
    """module -> (its lora_A key, its lora_B key), each a 2-D float matrix."""
    halves: dict[str, dict[str, str]] = {}
    for key, (dtype, shape) in header.items():
        match = _KEY.match(key)
        if match is None:
            raise refuse(name, f"unexpected tensor {_quote(key)} (only lora_A/lora_B "
                               "weights are supported)")
        if dtype not in _FLOATS:
            raise refuse(name, f"{_quote(key)} is {dtype}; LoRA weights are "
                               f"{', '.join(_FLOATS.values())}")
        if len(shape) != 2:
            raise refuse(name, f"{_quote(key)} is not a 2-D matrix (shape {shape})")
        half = halves.setdefault(match["module"], {})
        if match["ab"] in half:
            raise refuse(name, f"module {_quote(match['module'])} has two lora_{match['ab']} "
                               "weights")
        half[match["ab"]] = key
    if not halves:
        raise refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise refuse(name, f"module {_quote(module)} has no {missing} weight")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _check_targets(name: str, cfg: dict[str, Any], pairs: dict[str, tuple[str, str]],
                   base: BaseTargets) -> None:
    """Every adapted module is one the base has and we support; every listed target has
    weights."""
    for module in pairs:
        leaf = module.rpartition(".")[2]
        if leaf not in SUPPORTED:
            raise refuse(name, f"target module {_quote(leaf)} ({_quote(module)}) is not "
                               f"supported; only {', '.join(SUPPORTED)}")
        if module not in base.shapes:
            raise refuse(name, f"the base model has no module {_quote(module)}"
                               f"{_trained_on(cfg)}")
    listed = cfg.get("target_modules")
    if isinstance(listed, list | tuple):
        leaves = {m.rpartition(".")[2] for m in pairs}
        for target in listed:
            leaf = str(target).rpartition(".")[2]
            if leaf not in SUPPORTED:
                raise refuse(name, f"target module {_quote(target)} is not supported; only "
                                   f"{', '.join(SUPPORTED)}")
            if leaf not in leaves:
                raise refuse(name, f"target module {_quote(target)} is listed in "
                                   f"{CONFIG_FILE} but has no weights in {WEIGHTS_FILE}")


def _check_shapes(name: str, cfg: dict[str, Any], module: str, a: list[int], b: list[int],
                  rank: int, base: BaseTargets) -> None:
    """A [r, in] and B [out, r] against the config's r and the base's projection."""
    want = base.shapes[module]
    if a[0] != rank or b[1] != rank:
        raise refuse(name, f"{module} has rank {a[0]}/{b[1]} (lora_A/lora_B) but "
                           f"{CONFIG_FILE} says r={rank}")
    if a[1] != want.in_features or b[0] != want.out_features:
        raise refuse(name, f"{module} adapts a {a[1]} -> {b[0]} projection, the base "
                           f"model's is {want.in_features} -> {want.out_features}: an adapter "
                           f"for another base model{_trained_on(cfg)}")


def _trained_on(cfg: dict[str, Any]) -> str:
    """The adapter's own word on its base model (never the served model's name, which may
    be a server path)."""
    trained = cfg.get("base_model_name_or_path")
    return f" (it was trained on {_quote(repr(trained))})" if trained else ""


def _quote(value: object, limit: int = 80) -> str:
    """A value from the adapter's files as text (``repr`` unless a string), cut short: a
    key or a config value of any length must not make an error message of that length."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
