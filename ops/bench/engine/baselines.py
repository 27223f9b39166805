"""The transformers baselines: sequential generate, static batching, generate_batch.

Every function takes the same jobs and returns the generated token lists (for a
cross-check) — timing happens in the caller.
"""

from __future__ import annotations

from typing import Any

import torch

from ops.bench.engine.workload import Job


def load_hf(path: str, attn: str = "sdpa", device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn
    ).to(device)
    model.generation_config.eos_token_id = None  # ignore_eos for every system
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.inference_mode()
def sequential(model: Any, jobs: list[Job]) -> list[list[int]]:
    outs = []
    for job in jobs:
        ids = torch.tensor([job.prompt], device=model.device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=job.max_tokens, do_sample=False)
        outs.append(seq[0, len(job.prompt):].tolist())
    return outs


@torch.inference_mode()
def static_batches(model: Any, jobs: list[Job], batch: int = 8) -> list[list[int]]:
    """Batches of ``batch`` in arrival order, left-padded, each run to its longest output."""
    outs: list[list[int]] = []
    for start in range(0, len(jobs), batch):
        group = jobs[start:start + batch]
        width = max(len(j.prompt) for j in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, job in enumerate(group):
            ids[row, width - len(job.prompt):] = torch.tensor(job.prompt)
            mask[row, width - len(job.prompt):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        seq = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max(j.max_tokens for j in group))
        outs += [seq[r, width:width + j.max_tokens].tolist() for r, j in enumerate(group)]
    return outs


def hf_continuous(model: Any, jobs: list[Job], max_batch_tokens: int = 512,
                  page_size: int = 64, max_requests: int = 64,
                  cb_cfg: Any = None) -> list[list[int]]:
    """transformers' own continuous batching, with per-request max_new_tokens.

    Not under inference_mode: its generation thread updates tensors in place.
    """
    from transformers import GenerationConfig

    from ops.bench.engine.engine_gpu import hf_continuous_config

    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                               max_new_tokens=max(j.max_tokens for j in jobs))
    if cb_cfg is None:
        cb_cfg = hf_continuous_config(
            page=page_size, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests, num_blocks=4096 // page_size * 16,
            allow_block_sharing=False,
        )
    results: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30,
    ) as manager:
        ids = [manager.add_request(j.prompt, request_id=f"r{i}", max_new_tokens=j.max_tokens)
               for i, j in enumerate(jobs)]
        while len(results) < len(jobs):
            res = manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError("generate_batch stalled")
            if res.is_finished():
                results[res.request_id] = list(res.generated_tokens)
    return [results[i] for i in ids]
