"""The benchmark model and workloads, seeded so every system sees the same requests.

Model: a Llama config of about 30M parameters (hidden 512, intermediate 1408, 8 layers,
8 heads, 4 KV heads, vocab 8192) with seeded random weights, and a word-level tokenizer
covering its whole vocabulary so detokenization costs what it would with a real one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

VOCAB = 8192
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache"  # ops/bench/.cache


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


def build_bench_model(root: Path = CACHE_DIR, seed: int = 0) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = root / "llama-30m"
    if (path / "model.safetensors").exists():
        return str(path)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1")
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def main_workload(n: int = 64, seed: int = 0) -> list[Job]:
    """64 requests, prompts 32-512 tokens, outputs 16-256 tokens."""
    rng = random.Random(seed)
    return [
        Job([rng.randrange(2, VOCAB) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def classic_workload(seed: int = 1) -> list[Job]:
    """The 8-request example: outputs 20, 45, 80, 120, 150, 90, 60, 200 tokens."""
    rng = random.Random(seed)
    outs = [20, 45, 80, 120, 150, 90, 60, 200]
    return [Job([rng.randrange(2, VOCAB) for _ in range(64)], n) for n in outs]


def run_jobs(engine: object, jobs: list[Job]) -> list[list[int]]:
    """Every job on an ``Engine`` at once, greedy with EOS ignored (each exactly
    ``max_tokens`` long); the output token ids in job order."""
    from protocol.sampling import SamplingParams

    for i, job in enumerate(jobs):
        engine.add_request(str(i), job.prompt, SamplingParams(  # type: ignore[attr-defined]
            temperature=0, max_tokens=job.max_tokens, ignore_eos=True))
    outs: list[list[int]] = [[] for _ in jobs]
    from worker.engine.output.text_output import TextOutputs

    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        for out in TextOutputs.of(engine).step():  # type: ignore[arg-type]
            outs[int(out.request_id)] += out.new_token_ids
    return outs
