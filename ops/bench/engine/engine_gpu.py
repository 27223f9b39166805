"""GPU engine benchmark: Ferry beside transformers, on random-weight Llama shapes, one run.

    python ops/bench/engine/engine.py --device cuda --model-size 1b --workload mixed-gpu
    python ops/bench/engine/engine.py --device cuda --model-size 8b --workload throughput-256
    python ops/bench/engine/engine.py --device cuda --model-size 1b --profile
    python ops/bench/engine/engine.py --device cpu --model-size tiny --scale 0.02   # smoke (CI)

Models are Llama configs of real shapes with seeded random weights, initialised directly on
the device and cached under ``ops/bench/.cache`` with a word-level tokenizer covering the
vocabulary (never a hub download). Every request is exactly ``max_tokens`` long (EOS
ignored). Rows in one run: Ferry, transformers' continuous batching manager (its config
is built from whatever fields the installed transformers has: ``block_size`` in 5.17,
``page_size`` later), static batches, and sequential ``generate`` on a small subset.
``--profile`` times one full-batch decode step: wall time, device time (torch.profiler)
and kernel launches. Results go to ``ops/bench/results/engine-<gpu>.json``.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ops.bench.engine.workload import CACHE_DIR, Job


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_pos: int = 4096


SIZES = {
    "tiny": ModelSize(64, 2, 4, 2, 128, 1024, 2048),  # the CPU smoke test
    "1b": ModelSize(2048, 16, 32, 8, 8192, 32000),  # Llama-3.2-1B shape, 32k vocab
    "8b": ModelSize(4096, 32, 32, 8, 14336, 128256),  # Llama-3-8B shape
}


def build_model(size: str, device: str, root: Path = CACHE_DIR) -> str:
    """A cached random-weight checkpoint of ``size`` (bf16 on CUDA, fp32 on CPU)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    spec = SIZES[size]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    path = root / f"llama-{size}-{str(dtype).split('.')[-1]}"
    if (path / "config.json").exists():
        return str(path)
    cfg = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_pos,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, dtype=dtype,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to_empty(device=device)  # no CPU-side init of billions of weights
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    # Non-persistent buffers (rotary frequencies) are not saved: loading recomputes them.
    vocab = {f"w{i}": i for i in range(spec.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1")
    model.save_pretrained(path)
    fast.save_pretrained(path)
    del model
    return str(path)


def mixed_gpu(vocab: int, scale: float = 1.0, seed: int = 0) -> list[Job]:
    """256 requests, prompts 64-1024 tokens, outputs 64-512 (scaled for smoke runs)."""
    rng = random.Random(seed)
    n = max(2, round(256 * scale))
    shrink = min(1.0, scale * 8)
    hi_p, hi_o = max(65, round(1024 * shrink)), max(65, round(512 * shrink))
    return [Job([rng.randrange(2, vocab) for _ in range(rng.randint(64, hi_p))],
                rng.randint(64, hi_o)) for _ in range(n)]


def throughput_256(vocab: int, scale: float = 1.0, seed: int = 1) -> list[Job]:
    """vLLM's ``benchmark_throughput.py --input-len 256 --output-len 256``, 1,000 prompts."""
    rng = random.Random(seed)
    return [Job([rng.randrange(2, vocab) for _ in range(256)], 256)
            for _ in range(max(2, round(1000 * scale)))]


WORKLOADS = {"mixed-gpu": mixed_gpu, "throughput-256": throughput_256}


def hf_continuous_config(**wanted: Any) -> Any:
    """transformers' ContinuousBatchingConfig from the fields this version has: the page
    size is ``page_size`` in recent releases and ``block_size`` in 5.17."""
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = wanted.pop("page", 256)
    wanted["page_size" if "page_size" in fields else "block_size"] = page
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def gpu_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    raw = torch.cuda.get_device_name(torch.device(device))
    return re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")


def profile_decode_step(engine: Any, batch: int, context: int, steps: int = 5) -> dict[str, Any]:
    """Fill the batch with ``batch`` requests of ``context`` tokens, run until every one is
    decoding, then time ``steps`` pure-decode steps: wall, device time, kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    from protocol.sampling import SamplingParams

    vocab = engine.runner.shape.vocab_size
    rng = random.Random(5)
    for i in range(batch):
        engine.add_request(f"p{i}", [rng.randrange(2, vocab) for _ in range(context)],
                           SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    engine.step()  # warm: decode-only from here on
    cuda = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or "cuLaunch" in e.key)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "context": context, "wall_ms": round(wall * 1e3, 3),
            "device_ms": round(device_us / steps / 1e3, 3),
            "launches_per_step": round(launches / steps, 1),
            "wall_over_device": round(wall * 1e3 / (device_us / steps / 1e3), 3)
            if device_us else None}
