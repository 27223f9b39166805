"""A lean forward for the steps of a model on the CPU (decodes and prefills), for every
family ``layer_plan.py`` describes.

Why: at one stream the default model's step is ~6 ms, and most of it is not arithmetic
but transformers' per-module Python (``nn.Module.__call__``, kwarg deprecation and
output-capturing wrappers, config attribute lookups, the rotary module per step) and the
attention backend's per-layer argument checks. This path runs the same torch ops on the
same weights with none of that: one Python function per layer, the rotary cos/sin read
from a table, the step's block tables and lengths checked once and the C++ decode kernel
called directly for every layer.

Exact by construction: every op is the one the family's transformers modules run (the
same ``F.linear`` or ``PackedLinear`` per projection, the same norm, rotary, MLP or MoE
formulas in the same order, ``lean_ops.py``; the same kernel with the same window, soft
cap and scale), so the logits are bit-for-bit those of the module path
(``tests/worker/engine/runner/test_lean_decode.py``; every family in
``tests/worker/engine/test_families.py``). The rotary table rows are made by the model's
own rotary module, as the module path computes them.

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

Only for what it reproduces (``layer_plan.build``): Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3, Phi-3, Mixtral and Qwen3-MoE; any other model, or one of these with a feature the
plan lacks, keeps the module path, decided at load and logged (``lean_decode_off``); so
does one whose lean logits differ from the module path's on a probe at load
(``lean_probe.py``). With
multi-LoRA on, the path is built over the ``LoraLinear`` wrappers, so a decode row's
adapter is applied by the very module call the module path makes.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from kernels import cpu_decode_attention, reference
from worker.engine.runner.attention.metadata import AttentionBackend, AttentionMetadata, KVCache
from worker.engine.runner.attention.torch_backends import short_chunks
from worker.engine.runner.cpu import layer_plan
from worker.engine.runner.cpu.layer_plan import LayerPlan, ModelPlan
from worker.engine.runner.cpu.lean_ops import rotate
from worker.engine.runner.cpu.lean_probe import probe_mismatch

_log = structlog.get_logger("ferry.worker.lean_decode")
_Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table key -> (cos, sin) [T, 1, R]


def build_lean_decode(model: Any, backend: AttentionBackend,
                      probe: bool = True) -> LeanDecode | None:
    """The lean path for this model, or None (logged with the reason) where it would not
    reproduce the modules: no description of the model (``layer_plan.build``), or, with
    ``probe``, other logits than the module path's on a probe (``lean_probe.py``)."""
    plan = layer_plan.build(model)
    reason = plan if isinstance(plan, str) else None
    lean = None if isinstance(plan, str) else LeanDecode(model, backend, plan)
    if lean is not None and probe:
        reason = probe_mismatch(model, lean, backend)
    if reason is not None or lean is None:
        _log.info("lean_decode_off", model=type(model).__name__, reason=reason)
        return None
    _log.info("lean_decode_on", model=type(model).__name__, family=lean.plan.family)
    return lean


class LeanDecode:
    """Logits of a step, computed as the family's modules compute them."""

    def __init__(self, model: Any, backend: AttentionBackend, plan: ModelPlan) -> None:
        inner = model.model
        self.plan = plan
        # the embedding module's own forward (an int8 table dequantizes its rows there;
        # Gemma's scale is applied there)
        self.embed = inner.embed_tokens.forward
        self.dtype = inner.norm.weight.dtype  # the model's dtype
        self.vocab_size = int(model.config.vocab_size)
        self.lm_head = model.lm_head.forward
        self.rotary = inner.rotary_emb
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.head_dim = plan.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.layers: list[LayerPlan] = plan.layers
        self.backend = backend
        self.native = backend.name == "cpu"  # the C++ kernel, called directly
        empty = torch.empty(0, 1, dtype=self.dtype)  # [0, R]: grown at the first step
        self.tables: _Rope = {key: (empty, empty) for key in {layer.rope for layer in self.layers}}

    def _grow_rope(self, length: int) -> None:
        """Rotary rows for positions [0, length), from the model's rotary module over the new
        positions in one call: what the module path computes for a chunk of them, and for
        each row what a one-row decode step gets (each value is one product and its cos or
        sin, the same for a position alone or among others; the tests hold both paths to
        it). One call, not one per position: growing to 1024 rows took ~45 ms that way,
        paid inside some request's step. One table per layer type where the model has
        several (Gemma 3's local and global bases)."""
        for key, (cos, sin) in self.tables.items():
            have = cos.shape[0]
            if length <= have:
                continue
            new = max(length, 2 * have, 64)
            probe = torch.zeros(1, 1, 1, dtype=self.dtype)  # the module reads its dtype/device
            pos = torch.arange(have, new)[None]
            add_cos, add_sin = self.rotary(probe, pos, key) if key else self.rotary(probe, pos)
            self.tables[key] = (torch.cat([cos, add_cos[0]]) if have else add_cos[0],  # [new, R]
                                torch.cat([sin, add_sin[0]]) if have else add_sin[0])

    def usable(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Every slot real and a cache the kernel reads (any mix of rows: decodes and short
        chunks go to the kernel directly, longer chunks through the backend)."""
        if not len(meta.seq_lens_host) or not bool((meta.slot_mapping >= 0).all()):
            return False
        return not self.native or kv_caches[0][0].dtype in cpu_decode_attention.CACHE_DTYPES

    def _kernel_rows_only(self, meta: AttentionMetadata) -> bool:
        """Whether every row is a decode or a short chunk over its cached prefix (then one
        kernel call per layer is the whole attention). With a soft cap the backend attends
        short chunks on the reference, so only decodes count."""
        if meta.num_decodes == len(meta.seq_lens_host):
            return True
        if self.plan.any_soft_cap:
            return False
        tokens, _, _ = short_chunks(meta)
        return meta.num_decodes + len(tokens) == meta.query_start_host[-1]

    @staticmethod
    def _decode_call(meta: AttentionMetadata) -> cpu_decode_attention.DecodeCall:
        """The kernel call of every layer: one decode row per query token. Decodes come
        first, then each short chunk's tokens in order, so row r is token r of the step
        (what ``CpuAttentionBackend`` computes for the same step, row for row)."""
        nd = meta.num_decodes
        if nd == len(meta.seq_lens_host):
            return cpu_decode_attention.DecodeCall(meta.block_tables[:nd], meta.seq_lens[:nd], 1.0)
        _, seqs, lens = short_chunks(meta)
        tables = torch.cat([meta.block_tables[:nd], meta.block_tables[torch.tensor(seqs)]])
        seq_lens = torch.cat([meta.seq_lens[:nd], meta.seq_lens.new_tensor(lens)])  # [T]
        return cpu_decode_attention.DecodeCall(tables, seq_lens, 1.0)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[KVCache],
                 sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; returns logits [len(sample_rows), vocab]."""
        self._grow_rope(meta.max_seq_len)
        rope: _Rope = {key: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                       for key, (cos, sin) in self.tables.items()}  # [T, 1, R] each
        slots = meta.slot_mapping.to(torch.long)
        attend = self._decode_call(meta) if (
            self.native and self._kernel_rows_only(meta)) else None
        h = self.embed(input_ids)  # [T, H]
        for i, layer in enumerate(self.layers):
            h = self._layer_forward(h, layer, rope[layer.rope], slots, kv_caches[i], meta,
                                    attend)
        if not sample_rows.numel():  # a chunk that samples nothing: the layers' K/V only
            return h.new_empty(0, self.vocab_size)
        h = self.plan.final_norm(h)
        logits = self.lm_head(h[sample_rows])  # [N, vocab]
        cap = self.plan.final_soft_cap
        if cap is not None:  # Gemma's head, op for op
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]

    def _qkv(self, x: torch.Tensor, layer: LayerPlan
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, Hq, D], k and v [T, Hkv, D], q/k normed where the family does."""
        t, d = x.shape[0], self.head_dim
        if layer.qkv is not None:  # one fused projection, q then k then v
            qkv = layer.qkv(x)  # [T, (Hq + 2 Hkv) D]
            q = qkv[..., :self.q_size]
            k = qkv[..., self.q_size:self.q_size + self.kv_size]
            v = qkv[..., self.q_size + self.kv_size:]
        else:
            assert layer.q is not None and layer.k is not None and layer.v is not None
            q, k, v = layer.q(x), layer.k(x), layer.v(x)
        q = q.view(t, self.num_heads, d)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        return q, k, v

    def _layer_forward(self, h: torch.Tensor, layer: LayerPlan,
                       rope: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                       cache: KVCache, meta: AttentionMetadata,
                       attend: cpu_decode_attention.DecodeCall | None) -> torch.Tensor:
        """One decoder layer on h [T, H]: attention then feed-forward, each with its
        residual (and Gemma's norms around both)."""
        t = h.shape[0]
        q, k, v = self._qkv(layer.ln1(h), layer)
        cos, sin = rope
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if attend is not None:  # store the step's K/V as reference.store_kv does
            k_cache, v_cache = cache
            if k_cache.dtype == reference.FP8_E4M3:  # saturated, through the bytes
                reference.store_kv(k, v, k_cache, v_cache, slots)
            else:
                k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                    0, slots, k.to(k_cache.dtype))
                v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                    0, slots, v.to(v_cache.dtype))
            out = attend(q, k_cache, v_cache, layer.scale, *layer.kernel_mask)  # [T, Hq, D]
        else:  # the backend stores and attends itself (prefill chunks)
            out = self.backend.forward(q, k, v, cache, meta, layer.scale, layer.window,
                                       layer.soft_cap)
        out = layer.o(out.reshape(t, self.q_size))
        if layer.post_attn is not None:
            out = layer.post_attn(out)
        h = h + out
        x = layer.mlp(layer.ln2(h))
        if layer.post_ff is not None:
            x = layer.post_ff(x)
        return h + x
