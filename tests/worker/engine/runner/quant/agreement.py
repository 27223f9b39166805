"""Shared by the quantization tests: tiny test checkpoints (a dense Llama, a Qwen3 with tied
embeddings and q/k norms, a Mixtral MoE and a Qwen3-MoE), the fp32 references of the
quantized layers, and vLLM's greedy agreement rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint, build_tokenizer, save_seeded

PROMPTS = ["def fibonacci(n):", "class Queue:\n    ", "import os\nimport"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)


def build_moe(root: Path, seed: int = 0) -> str:
    """A two-layer Mixtral (4 experts, top-2), random weights, with the test tokenizer."""
    import transformers

    path = root / "mixtral"
    if (path / "config.json").exists():
        return str(path)
    tokenizer = build_tokenizer()
    config = transformers.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    return save_seeded(config, tokenizer, path, seed)


def checkpoint(arch: str, root: Path) -> str:
    return build_moe(root) if arch == "mixtral" else build_checkpoint(arch, root)


def generate(path: str, **options: Any) -> list[Any]:
    """Greedy choices (token ids and top-5 logprobs) of every prompt."""
    from worker.engine.llm import LLM

    llm = LLM(path, kv_cache_blocks=64, **options)
    return [out.choices[0] for out in llm.generate(PROMPTS, GREEDY)]


def fp8_reference_forward(self: Any, x: Any) -> Any:
    """What an FP8 W8A8 layer computes, in fp32 torch: the activations quantized and
    dequantized as the scheme says (per token, or the static scale), times the dequantized
    weight. The reference for FP8: activation rounding is part of the scheme, and on these
    tiny random models (top logprobs within ~0.1 of each other) it alone moves tokens."""
    import torch

    flat = x.reshape(-1, self.in_features).float()
    if self.input_scale is not None:
        scale = self.input_scale
    else:
        scale = (flat.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    xq = (flat / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    out = (xq @ self.dequantized().t()).to(x.dtype)
    if self.bias is not None:
        out = out + self.bias
    return out.view(*x.shape[:-1], self.out_features)


def dequantized_expert_reference(self: Any, e: int, rows: Any) -> Any:
    """What a quantized expert computes, in fp32 torch on its dequantized weights (the
    reference for FP8 experts, whose model's attention layers need ``fp8_reference_forward``
    in the same run)."""
    import torch.nn.functional as F

    w13, w2 = self.dequantized()  # [E, 2I, H], [E, H, I] fp32
    gate, up = F.linear(rows.float(), w13[e]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[e]).to(rows.dtype)


EXPERT_LINEARS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def expert_weight_keys(state: dict[str, Any], module: str, experts: int) -> list[tuple[str, ...]]:
    """Per expert, the checkpoint keys of its (gate, up, down) weights, for the model's
    experts module ``module`` (Mixtral's checkpoints name it ``block_sparse_moe``)."""
    for prefix in (module, module.replace(".mlp.experts", ".block_sparse_moe.experts")):
        for names in EXPERT_LINEARS:
            if f"{prefix}.0.{names[0]}.weight" in state:
                return [tuple(f"{prefix}.{e}.{n}.weight" for n in names) for e in range(experts)]
    raise KeyError(f"no expert weights of {module} in the checkpoint")


def assert_top5_agreement(got: list[Any], want: list[Any]) -> None:
    """vLLM's rule: tokens equal up to the first position where they differ, and there each
    side's token is among the other's top-5 logprobs (then the rest is not compared)."""
    for g, w in zip(got, want, strict=True):
        for pos, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=False)):
            if a == b:
                continue
            top_g = {tok for tok, _ in g.logprobs[pos][1]}
            top_w = {tok for tok, _ in w.logprobs[pos][1]}
            assert b in top_g and a in top_w, (
                f"position {pos}: {a} (top {sorted(top_g)}) vs {b} (top {sorted(top_w)})")
            break
