"""Seeded random PEFT LoRA adapters written at test time (``peft`` is not needed).

The files are what PEFT's ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_A.weight``.
B is random too (PEFT initialises it to zero), so every adapter changes the outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.engine.lora.targets import BaseTargets

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTN, "gate_proj", "up_proj", "down_proj")


def write_adapter(root: Path, base: BaseTargets, *, rank: int = 8, alpha: float = 16,
                  targets: tuple[str, ...] = ALL, seed: int = 0, rslora: bool = False,
                  std: float = 0.1, **config: Any) -> str:
    """Write an adapter of ``base`` under ``root``; returns its directory."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, shape in base.shapes.items():
        if module.rpartition(".")[2] not in targets:
            continue
        a = torch.randn(rank, shape.in_features, generator=gen) / shape.in_features ** 0.5
        b = torch.randn(shape.out_features, rank, generator=gen) * std
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
           "target_modules": list(targets), "bias": "none", "task_type": "CAUSAL_LM",
           "base_model_name_or_path": base.name, **config}
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    return str(root)


def merged_state(model: torch.nn.Module, path: str, scale: float) -> dict[str, torch.Tensor]:
    """``model``'s state dict with the adapter at ``path`` merged: W + scale * B @ A."""
    from safetensors.torch import load_file

    state = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        weight = state[f"{module}.weight"]
        state[f"{module}.weight"] = (weight.double() + scale * (b.double() @ a.double())
                                     ).to(weight.dtype)
    return state
