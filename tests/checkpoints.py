"""Small seeded random checkpoints of real architectures, built at test time.

Each checkpoint gets a real byte-level BPE tokenizer trained in-process on a fixed text,
so prompts, detokenization and chat templates exercise real code paths offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_CORPUS = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nclass Queue:\n    '''A FIFO queue.'''\n    def push(self, item):\n"
    "        self.items.append(item)\n"
    "The quick brown fox jumps over the lazy dog. Ferry serves language models. "
    "Grüße, naïve café — 日本語のテキスト and emoji 🚀🔥 mixed in. "
) * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
# Qwen3's switch, as its template reads it: thinking off closes an empty thought first
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<|end|>{% endif %}"
)


def build_tokenizer(vocab_size: int = 384, fim: bool = False) -> Any:
    """``fim``: also FIM special tokens and a chat template with ``enable_thinking``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>",
                        *(FIM_TOKENS if fim else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = THINKING_TEMPLATE if fim else CHAT_TEMPLATE
    return fast


ARCHS: dict[str, dict[str, Any]] = {
    # GQA, untied
    "llama": dict(cls="LlamaConfig", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False),
    # MHA with a sliding window
    "mistral": dict(cls="MistralConfig", num_attention_heads=4, num_key_value_heads=4,
                    sliding_window=48, tie_word_embeddings=False),
    # GQA, tied embeddings, qkv bias
    "qwen2": dict(cls="Qwen2Config", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True),
    # GQA, q/k norms, explicit head_dim
    "qwen3": dict(cls="Qwen3Config", num_attention_heads=4, num_key_value_heads=1,
                  head_dim=16, tie_word_embeddings=True),
    # mixtures of experts: top-2 of 4, top-2 of 4 plus a shared expert, top-4 of 8, top-1
    "mixtral": dict(cls="MixtralConfig", num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_attention_heads=4, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, tie_word_embeddings=False),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=4,
                      moe_intermediate_size=32, tie_word_embeddings=False),
    "olmoe": dict(cls="OlmoeConfig", num_attention_heads=4, num_key_value_heads=4,
                  num_experts=8, num_experts_per_tok=1, tie_word_embeddings=False),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def build_checkpoint(arch: str, root: Path, *, seed: int = 0, layers: int = 2,
                     hidden: int = 64, max_pos: int = 512, fim: bool = False) -> str:
    """Write a random ``arch`` checkpoint plus tokenizer under ``root``; returns its path.
    ``fim``: a tokenizer with FIM tokens and a thinking switch (``build_tokenizer``)."""
    import transformers

    path = root / (f"{arch}-fim" if fim else arch)
    if (path / "config.json").exists():
        return str(path)
    spec = dict(ARCHS[arch])
    cfg_cls = getattr(transformers, spec.pop("cls"))
    tokenizer = build_tokenizer(fim=fim)
    config = cfg_cls(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, max_position_embeddings=max_pos,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, **spec,
    )
    if arch == "mistral":
        config.sliding_window = spec["sliding_window"]
    return save_seeded(config, tokenizer, path, seed)


def save_seeded(config: Any, tokenizer: Any, path: Path | str, seed: int) -> str:
    """Build ``config``'s model with seeded weights larger than its init (matrices
    N(0, 0.2), so outputs are not all near-ties; attention sinks N(0, 1), so they bite),
    save it with ``tokenizer`` at ``path`` and return the path."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif p.dim() > 1:
                p.normal_(0.0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
