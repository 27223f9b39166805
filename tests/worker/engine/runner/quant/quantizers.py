"""A small reference quantizer for the tests: writes a float test checkpoint again in each
quantized format (compressed-tensors FP8 and INT8, ModelOpt FP8, AWQ, GPTQ), and beside it
the dequantized fp32 checkpoint the served tokens are compared with.

Written from the formats' descriptions, independently of the loader's unpacking code, so a
layout mistake on either side shows up as a token mismatch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = ("w1", "w2", "w3")  # Mixtral's experts.{e}.w1/w2/w3 (Qwen3-MoE: above)
FP8 = torch.float8_e4m3fn
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ's order [0, 2, 4, 6, 1, 3, 5, 7], inverted
STATIC_INPUT_SCALE = 0.05  # covers |x| up to 22 (fp8's 448 x 0.05): the test models' range


def _targets(state: dict[str, torch.Tensor], experts: bool) -> list[str]:
    """Module names of the projections (each expert's too when ``experts``; not the head,
    not the router)."""
    def target(key: str) -> bool:
        proj = key.split(".")[-2]
        in_experts = ".experts." in key
        return (proj in PROJECTIONS or (in_experts and proj in EXPERT_PROJECTIONS)) \
            and (experts or not in_experts)

    return [k[: -len(".weight")] for k, v in state.items()
            if k.endswith(".weight") and v.dim() == 2 and target(k)]


def _pack_rows_of_8(nib: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8]: value j of a word in bits 4j..4j+3."""
    r, c = nib.shape
    words = nib.to(torch.int64).view(r, c // 8, 8) << (torch.arange(8) * 4)
    v = words.sum(-1)  # [R, C/8] in 0 .. 2^32 - 1
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def _quant_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().view(1)
    scale = amax / 448.0
    q = (w / (scale if per_channel else scale[0])).to(FP8)
    return q, scale.float()


def _int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric min/max 4-bit groups: (q [N, K], scale [N, K/g], zero [N, K/g])."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()  # stored in fp16
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return q.view(n, k).to(torch.int32), scale, zero


def _dequant_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  group: int) -> torch.Tensor:
    n, k = q.shape
    return ((q.view(n, k // group, group) - zero[..., None]) * scale[..., None]).view(n, k)


def _layer(fmt: str, w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor],
                                                          torch.Tensor]:
    """The quantized tensors of one layer (suffix -> tensor) and its dequantized weight."""
    if fmt in ("ct-fp8-channel", "ct-fp8-static", "modelopt"):
        per_channel = fmt == "ct-fp8-channel"
        q, scale = _quant_fp8(w, per_channel)
        deq = q.float() * (scale if per_channel else scale[0])
        out = {"weight": q, "weight_scale": scale if fmt != "modelopt" else scale[0]}
        if fmt != "ct-fp8-channel":
            s = torch.tensor([STATIC_INPUT_SCALE])
            out["input_scale"] = s if fmt != "modelopt" else s[0]
        return out, deq
    if fmt == "ct-int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    q, scale, zero = _int4_groups(w, group)
    deq = _dequant_int4(q, scale, zero, group)
    if fmt == "awq":  # [K, N/8] words over N, columns interleaved
        perm = torch.tensor([AWQ_NIBBLE_OF_COLUMN.index(i) for i in range(8)])
        interleave = lambda t: t.view(t.shape[0], -1, 8)[..., perm].reshape(t.shape)  # noqa: E731
        return {"qweight": _pack_rows_of_8(interleave(q.t().contiguous())),
                "qzeros": _pack_rows_of_8(interleave(zero.t().contiguous().to(torch.int32))),
                "scales": scale.t().contiguous().half()}, deq
    # gptq: [K/8, N] words over K; zeros over N, stored minus one
    k = q.shape[1]
    return {"qweight": _pack_rows_of_8(q).t().contiguous(),
            "qzeros": _pack_rows_of_8((zero.t() - 1).contiguous().to(torch.int32)),
            "scales": scale.t().contiguous().half(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}, deq


def quantization_config(fmt: str, group: int, ignore: list[str]) -> dict[str, Any]:
    if fmt.startswith("ct-"):
        fp8 = fmt != "ct-int8"
        weights = {"num_bits": 8, "type": "float" if fp8 else "int", "symmetric": True,
                   "strategy": "tensor" if fmt == "ct-fp8-static" else "channel",
                   "dynamic": False}
        acts = None if not fp8 else (
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
             "dynamic": True} if fmt == "ct-fp8-channel" else
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
             "dynamic": False})
        return {"quant_method": "compressed-tensors",
                "format": "float-quantized" if fp8 else "naive-quantized",
                "quantization_status": "compressed", "ignore": ignore,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": acts}}}
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ignore}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
            "sym": False, "checkpoint_format": "gptq"}


def write_quantized(src: str, fmt: str, root: Path, group: int = 32,
                    experts: bool = True) -> tuple[str, str]:
    """(quantized checkpoint dir, dequantized fp32 reference dir) for ``fmt``; an MoE's
    experts quantized like the dense layers unless ``experts`` is false."""
    tag = "" if experts else "-float-experts"
    qdir = root / f"{Path(src).name}-{fmt}{tag}"
    rdir = root / f"{Path(src).name}-{fmt}{tag}-ref"
    if (qdir / "config.json").exists():
        return str(qdir), str(rdir)
    state = {k: v.float() for k, v in load_file(str(Path(src) / "model.safetensors")).items()}
    quantized, reference = dict(state), dict(state)
    for name in _targets(state, experts):
        w = state[f"{name}.weight"]
        tensors, deq = _layer(fmt, w, group)
        del quantized[f"{name}.weight"]
        quantized.update({f"{name}.{s}": t.contiguous() for s, t in tensors.items()})
        reference[f"{name}.weight"] = deq.contiguous()
    for out, tensors in ((qdir, quantized), (rdir, reference)):
        shutil.copytree(src, out)
        save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, ["lm_head"])
    (qdir / "config.json").write_text(json.dumps(config))
    return str(qdir), str(rdir)
