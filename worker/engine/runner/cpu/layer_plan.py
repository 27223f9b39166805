"""What the lean CPU path runs for a model: one description per family of the layer shape
the families share, read from the loaded modules into one plan per layer.

The decoder layers of Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Mixtral and Qwen3-MoE
are one shape with a few switches, so the lean path is written once over the switches
(``FamilySpec``) rather than once per family:

* the norm's formula (Llama's RMSNorm, or Gemma's ``1 + w``) and placement (Gemma's
  "sandwich": a norm on the attention output and on the feed-forward's input and output);
* q/k norms on the head dim before rotary (Qwen3, Qwen3-MoE, Gemma 3);
* the projections, separate (with biases where the module has them: Qwen2) or fused
  (Phi-3's ``qkv_proj`` and ``gate_up_proj``); the feed-forward a gated MLP or a sparse
  MoE block (``lean_ops.mlp_fn``);
* what reaches attention: each layer's scale, its sliding window (read from the module
  where it is per layer, from the config where the module reads it there) and Gemma 2's
  logit soft cap;
* the rotary table: one, or one per layer type (Gemma 3's local and global bases);
* the head: a final logit soft cap (Gemma), tied or not (the LM head's own forward).

Embedding scales (Gemma) live in the embedding module's forward, which the path calls.
A model outside the table, or one with a feature the plan does not cover (a rope whose
frequencies depend on the sequence length, a norm or MLP class it has no copy of,
attention sinks, chunked attention, NoPE layers, bidirectional attention) gets no plan:
``build`` returns the reason, the runner logs it and the model keeps the module path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels import _checks as chk
from worker.engine.runner.attention.layer_features import CHUNK_ATTR, TEMPERATURE_ATTR
from worker.engine.runner.cpu.lean_ops import Fn, NotReproduced, mlp_fn, norm_fn


@dataclass(frozen=True)
class FamilySpec:
    """The switches of one family's decoder layer (module docstring)."""

    causal_lm: str  # the causal-LM class the description is of
    norm: str = "rms"  # "rms" (Llama) or "rms_1p" (Gemma's 1 + w)
    sandwich: bool = False  # Gemma: norms around attention's output and the feed-forward
    qk_norm: bool = False  # RMSNorm of q and k over the head dim, before rotary
    fused_qkv: bool = False  # Phi-3
    window: str = "none"  # where the layer's window comes from: "none", "module", "config"
    attn_soft_cap: bool = False  # Gemma 2 passes attn_logit_softcapping to attention
    rope_by_layer_type: bool = False  # Gemma 3: one rotary table per layer type
    final_soft_cap: bool = False  # Gemma: tanh cap of the logits


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("LlamaForCausalLM"),
    "mistral": FamilySpec("MistralForCausalLM", window="config"),
    "qwen2": FamilySpec("Qwen2ForCausalLM", window="module"),
    "qwen3": FamilySpec("Qwen3ForCausalLM", qk_norm=True, window="module"),
    "gemma2": FamilySpec("Gemma2ForCausalLM", norm="rms_1p", sandwich=True, window="module",
                         attn_soft_cap=True, final_soft_cap=True),
    "gemma3_text": FamilySpec("Gemma3ForCausalLM", norm="rms_1p", sandwich=True,
                              qk_norm=True, window="module", rope_by_layer_type=True,
                              final_soft_cap=True),
    "phi3": FamilySpec("Phi3ForCausalLM", fused_qkv=True, window="config"),
    "mixtral": FamilySpec("MixtralForCausalLM", window="config"),
    "qwen3_moe": FamilySpec("Qwen3MoeForCausalLM", qk_norm=True, window="module"),
}
# rope types whose frequencies change with the sequence length: a table by position
# would not hold what the module computes for a longer step
_DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer as the lean path runs it: bound forwards and closures."""

    ln1: Fn
    ln2: Fn
    post_attn: Fn | None  # sandwich norms (Gemma)
    post_ff: Fn | None
    qkv: Fn | None  # fused projection, or the three below
    q: Fn | None
    k: Fn | None
    v: Fn | None
    q_norm: Fn | None
    k_norm: Fn | None
    o: Fn
    mlp: Fn
    scale: float
    window: int | None
    soft_cap: float | None
    rope: str  # the rotary table's key ("" where the model has one)
    kernel_mask: tuple[int, float]  # (window, soft cap) as the C++ kernel takes them


@dataclass(frozen=True)
class ModelPlan:
    family: str
    spec: FamilySpec
    layers: list[LayerPlan]
    final_norm: Fn
    num_heads: int
    num_kv_heads: int
    head_dim: int
    final_soft_cap: float | None

    @property
    def any_soft_cap(self) -> bool:
        return any(layer.soft_cap for layer in self.layers)


def build(model: Any) -> ModelPlan | str:
    """The plan of ``model``, or why it has none."""
    cfg = model.config
    family = getattr(cfg, "model_type", None)
    spec = FAMILIES.get(str(family))
    if spec is None:
        return f"no lean description of model type {family!r}"
    if type(model).__name__ != spec.causal_lm:
        return f"{type(model).__name__} is not the described {spec.causal_lm}"
    reason = _unsupported(model, spec)
    if reason is not None:
        return reason
    inner = model.model
    try:
        layers = [_layer(layer, spec, cfg) for layer in inner.layers]
        final_norm = norm_fn(inner.norm, spec.norm)
    except (NotReproduced, AttributeError) as exc:
        return str(exc)
    att = inner.layers[0].self_attn
    cap = getattr(cfg, "final_logit_softcapping", None) if spec.final_soft_cap else None
    return ModelPlan(str(family), spec, layers, final_norm, int(cfg.num_attention_heads),
                     int(cfg.num_key_value_heads), int(att.head_dim),
                     float(cap) if cap else None)


def _unsupported(model: Any, spec: FamilySpec) -> str | None:
    """What the model asks for beyond the description, if anything."""
    cfg = model.config
    rotary = model.model.rotary_emb
    rope_types = rotary.rope_type
    types = list(rope_types.values()) if isinstance(rope_types, dict) else [rope_types]
    for rope in types:
        if any(d in str(rope) for d in _DYNAMIC_ROPE):
            return f"rope type {rope!r} changes with the sequence length"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if len(model.model.layers) != cfg.num_hidden_layers:
        return "a layer count other than num_hidden_layers"
    for layer in model.model.layers:
        att = layer.self_attn
        if getattr(att, CHUNK_ATTR, None) or getattr(att, TEMPERATURE_ATTR, None):
            return "chunked attention or NoPE temperature tuning"
        if getattr(att, "sinks", None) is not None:
            return "attention sinks"
        if not getattr(att, "is_causal", True):
            return "non-causal attention"
    return None


def _layer(layer: Any, spec: FamilySpec, cfg: Any) -> LayerPlan:
    att = layer.self_attn
    n = spec.norm
    window: int | None = None
    if spec.window == "module":
        window = att.sliding_window
    elif spec.window == "config":
        window = getattr(cfg, "sliding_window", None)
    cap = att.attn_logit_softcapping if spec.attn_soft_cap else None
    sandwich = spec.sandwich
    return LayerPlan(
        ln1=norm_fn(layer.input_layernorm, n),
        ln2=norm_fn(layer.pre_feedforward_layernorm if sandwich
                    else layer.post_attention_layernorm, n),
        post_attn=norm_fn(layer.post_attention_layernorm, n) if sandwich else None,
        post_ff=norm_fn(layer.post_feedforward_layernorm, n) if sandwich else None,
        qkv=att.qkv_proj.forward if spec.fused_qkv else None,
        q=None if spec.fused_qkv else att.q_proj.forward,
        k=None if spec.fused_qkv else att.k_proj.forward,
        v=None if spec.fused_qkv else att.v_proj.forward,
        q_norm=norm_fn(att.q_norm, n) if spec.qk_norm else None,
        k_norm=norm_fn(att.k_norm, n) if spec.qk_norm else None,
        o=att.o_proj.forward,
        mlp=mlp_fn(layer.mlp),
        scale=float(att.scaling),
        window=window,
        soft_cap=float(cap) if cap else None,
        rope=str(att.layer_type) if spec.rope_by_layer_type else "",
        kernel_mask=(chk.window_arg(window), chk.soft_cap_arg(cap)),
    )
