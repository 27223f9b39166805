"""A lean forward for the steps of a Llama model on the CPU (decodes and prefills).

Why: at one stream the default model's step is ~6 ms, and most of it is not arithmetic
but transformers' per-module Python (``nn.Module.__call__``, kwarg deprecation and
output-capturing wrappers, config attribute lookups, the rotary module per step) and the
attention backend's per-layer argument checks. This path runs the same torch ops on the
same weights with none of that: one Python function per layer, the rotary cos/sin read
from a table, the step's block tables and lengths checked once and the C++ decode kernel
called directly for every layer.

Exact by construction: every op is the one transformers' Llama runs (the same
``F.linear`` or ``PackedLinear`` per projection, the same RMSNorm and rotary formulas in
the same order, the same kernel), so the logits are bit-for-bit those of the module path
(``tests/worker/engine/runner/test_lean_decode.py``). The rotary table rows are made by the
model's own rotary module, as the module path computes them.

Verification steps of speculative decoding take it too: a row whose query is its last
token and its drafts (a short chunk over a cached prefix, ``attention_torch.short_chunks``)
is, to the CPU backend, one decode row per query token in the same kernel call as the
decodes; here the call is built once per step with those rows' tables and lengths, so a
step carrying drafts costs what a decode step of as many tokens costs, not the module
path's ~2x (measured at batch 1: 3 ms for a decode, 9 ms for a 1+2..7-token verification).

Prefill and mixed steps take it too: the layers' ops are the same for a chunk of
many tokens, and a step with a chunk that is not kernel rows hands every layer's attention
to the backend's ``forward``, the call the module path's attention hook makes. A
conversation's returning turn (a short new message over a context restored from the
prefix cache) was ~1/3 module-path Python at the default model's size; a prompt's
rotary rows come from the table too. The logits
equal the module path's when both run the step on the same threads (a prefill's matmuls
are not bit-stable across thread counts on either path).

Only for what it reproduces: ``LlamaForCausalLM`` with default RoPE, SiLU MLP, no
sliding window. With
multi-LoRA on, the path is built over the ``LoraLinear`` wrappers, so a decode row's
adapter is applied by the very module call the module path makes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels import cpu_decode_attention, reference
from worker.engine.runner.attention.metadata import AttentionBackend, AttentionMetadata, KVCache
from worker.engine.runner.attention.torch_backends import short_chunks

_Layer = tuple[Any, ...]  # (ln1 w, eps1, q, k, v, o, ln2 w, eps2, gate, up, down)


def build_lean_decode(model: Any, backend: AttentionBackend) -> LeanLlamaDecode | None:
    """The lean path for this model, or None where it would not reproduce the modules."""
    cfg = model.config
    if type(model).__name__ != "LlamaForCausalLM" or cfg.model_type != "llama":
        return None
    rotary = model.model.rotary_emb
    if (getattr(rotary, "rope_type", None) != "default" or rotary.attention_scaling != 1.0
            or cfg.hidden_act != "silu" or getattr(cfg, "pretraining_tp", 1) != 1
            or getattr(cfg, "sliding_window", None)):
        return None
    return LeanLlamaDecode(model, backend)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm, op for op ([T, H] -> [T, H])."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanLlamaDecode:
    """Logits of a pure-decode step, computed as the Llama modules compute them."""

    def __init__(self, model: Any, backend: AttentionBackend) -> None:
        inner = model.model
        cfg = model.config
        # the embedding module's own forward (an int8 table dequantizes its rows there)
        self.embed = inner.embed_tokens.forward
        dtype = inner.norm.weight.dtype  # the model's dtype
        self.vocab_size = int(cfg.vocab_size)
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = model.lm_head.forward
        self.rotary = inner.rotary_emb
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.layers: list[_Layer] = [self._layer(layer) for layer in inner.layers]
        self.backend = backend
        self.native = backend.name == "cpu"  # the C++ kernel, called directly
        self.cos = torch.empty(0, self.head_dim, dtype=dtype)
        self.sin = torch.empty(0, self.head_dim, dtype=dtype)

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        return (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                att.q_proj.forward, att.k_proj.forward, att.v_proj.forward,
                att.o_proj.forward, layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon, mlp.gate_proj.forward,
                mlp.up_proj.forward, mlp.down_proj.forward)

    def _grow_rope(self, length: int) -> None:
        """Rotary rows for positions [0, length), from the model's rotary module over the new
        positions in one call: what the module path computes for a chunk of them, and for
        each row what a one-row decode step gets (each value is one product and its cos or
        sin, the same for a position alone or among others; the tests hold both paths to
        it). One call, not one per position: growing to 1024 rows took ~45 ms that way,
        paid inside some request's step."""
        have = self.cos.shape[0]
        if length <= have:
            return
        new = max(length, 2 * have, 64)
        probe = self.cos.new_zeros(1, 1, 1)  # the module reads only its dtype/device
        cos, sin = self.rotary(probe, torch.arange(have, new)[None])  # [1, new - have, D]
        self.cos = torch.cat([self.cos, cos[0]])  # [new, D]
        self.sin = torch.cat([self.sin, sin[0]])

    def usable(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Every slot real and a cache the kernel reads (any mix of rows: decodes and short
        chunks go to the kernel directly, longer chunks through the backend)."""
        if not len(meta.seq_lens_host) or not bool((meta.slot_mapping >= 0).all()):
            return False
        return not self.native or kv_caches[0][0].dtype in cpu_decode_attention.CACHE_DTYPES

    @staticmethod
    def _kernel_rows_only(meta: AttentionMetadata) -> bool:
        """Whether every row is a decode or a short chunk over its cached prefix (then one
        kernel call per layer is the whole attention)."""
        if meta.num_decodes == len(meta.seq_lens_host):
            return True
        tokens, _, _ = short_chunks(meta)
        return meta.num_decodes + len(tokens) == meta.query_start_host[-1]

    def _decode_call(self, meta: AttentionMetadata) -> cpu_decode_attention.DecodeCall:
        """The kernel call of every layer: one decode row per query token. Decodes come
        first, then each short chunk's tokens in order, so row r is token r of the step
        (what ``CpuAttentionBackend`` computes for the same step, row for row)."""
        nd = meta.num_decodes
        if nd == len(meta.seq_lens_host):
            return cpu_decode_attention.DecodeCall(
                meta.block_tables[:nd], meta.seq_lens[:nd], self.scale)
        _, seqs, lens = short_chunks(meta)
        tables = torch.cat([meta.block_tables[:nd], meta.block_tables[torch.tensor(seqs)]])
        seq_lens = torch.cat([meta.seq_lens[:nd], meta.seq_lens.new_tensor(lens)])  # [T]
        return cpu_decode_attention.DecodeCall(tables, seq_lens, self.scale)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[KVCache],
                 sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; returns logits [len(sample_rows), vocab]."""
        self._grow_rope(meta.max_seq_len)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        slots = meta.slot_mapping.to(torch.long)
        attend = self._decode_call(meta) if (
            self.native and self._kernel_rows_only(meta)) else None
        h = self.embed(input_ids)  # [T, H]
        for i, layer in enumerate(self.layers):
            h = self._layer_forward(h, layer, cos, sin, slots, kv_caches[i], meta, attend)
        if not sample_rows.numel():  # a chunk that samples nothing: the layers' K/V only
            return h.new_empty(0, self.vocab_size)
        h = _rms_norm(h, *self.norm)
        return self.lm_head(h[sample_rows])  # type: ignore[no-any-return]

    def _layer_forward(self, h: torch.Tensor, layer: _Layer, cos: torch.Tensor,
                       sin: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata,
                       attend: cpu_decode_attention.DecodeCall | None) -> torch.Tensor:
        """One decoder layer on h [T, H]: attention then MLP, each with its residual."""
        ln1, eps1, q_proj, k_proj, v_proj, o_proj, ln2, eps2, gate, up, down = layer
        t = h.shape[0]
        x = _rms_norm(h, ln1, eps1)
        q = q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        if attend is not None:  # store the step's K/V as reference.store_kv does
            k_cache, v_cache = cache
            if k_cache.dtype == reference.FP8_E4M3:  # saturated, through the bytes
                reference.store_kv(k, v, k_cache, v_cache, slots)
            else:
                k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                    0, slots, k.to(k_cache.dtype))
                v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                    0, slots, v.to(v_cache.dtype))
            out = attend(q, k_cache, v_cache)  # [T, Hq, D]
        else:  # the backend stores and attends itself (prefill chunks)
            out = self.backend.forward(q, k, v, cache, meta, self.scale, None, None)
        h = h + o_proj(out.reshape(t, self.num_heads * self.head_dim))
        x = _rms_norm(h, ln2, eps2)
        return h + down(F.silu(gate(x)) * up(x))
