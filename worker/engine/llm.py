"""Offline batch generation with the interface vLLM users know: ``LLM(...).generate``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from protocol.sampling import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.output.outputs import ChoiceOutput, CompletionOutput
from worker.engine.output.text_output import TextOutputs

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_blocks: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        if model is None:
            from worker.models import default_model_path

            model = default_model_path()
        config = EngineConfig.create(
            model, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, num_blocks=kv_cache_blocks,
            dtype=dtype, device=device, attention_backend=attention_backend, **kwargs,
        )
        self.engine = Engine(config)
        self.text = TextOutputs(self.engine)  # token ids -> text, in this process
        self._ids = itertools.count()

    def close(self) -> None:
        """End the tensor-parallel ranks, if any (``tensor_parallel_size`` > 1)."""
        self.engine.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion, sharing the batch; outputs in prompt order.
        ``lora_name``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); adapters are loaded with ``LLM(lora_modules=["NAME=PATH"])`` or
        ``llm.engine.lora.add_adapter(name, path)``."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"params: got {len(param_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        names = [lora_name] * len(prompt_list) if lora_name is None or isinstance(
            lora_name, str) else list(lora_name)
        if len(names) != len(prompt_list):
            raise ValueError(f"lora_name: got {len(names)} names for {len(prompt_list)} prompts")
        results: dict[str, CompletionOutput] = {}
        choices: dict[str, dict[int, ChoiceOutput]] = {}
        order: list[str] = []
        for prompt, p, name in zip(prompt_list, param_list, names, strict=True):
            rid = f"llm-{next(self._ids)}"
            request = self.engine.add_request(rid, prompt, p, lora_name=name)
            results[rid] = CompletionOutput(rid, list(request.prompt_token_ids))
            choices[rid] = {i: ChoiceOutput(i) for i in range(p.num_candidates)}
            order.append(rid)
        while self.engine.has_unfinished_requests():
            for out in self.text.step():
                choice = choices[out.request_id][out.index]
                choice.token_ids.extend(out.new_token_ids)
                choice.text += out.text
                if out.logprobs is not None:
                    choice.logprobs = (choice.logprobs or []) + out.logprobs
                if out.finished:
                    choice.finish_reason = out.finish_reason
                    choice.stop_reason = out.stop_reason
                    choice.cumulative_logprob = out.cumulative_logprob
                    if out.error is not None:
                        results[out.request_id].error = out.error
        for rid, p in zip(order, param_list, strict=True):
            _settle(results[rid], list(choices[rid].values()), p)
        return [results[rid] for rid in order]


def _settle(result: CompletionOutput, choices: list[ChoiceOutput], params: SamplingParams) -> None:
    """Pick the returned choices (the best ``n`` of ``best_of`` by cumulative logprob) and
    mirror the first one's fields on the result."""
    if params.ranks_candidates:
        choices = sorted(choices, key=lambda c: -(c.cumulative_logprob or float("-inf")))
        choices = choices[: params.n]
        for i, choice in enumerate(choices):
            choice.index = i
    result.choices = choices
    first = choices[0]
    result.token_ids, result.text = first.token_ids, first.text
    result.finish_reason, result.logprobs = first.finish_reason, first.logprobs
    result.stop_reason = first.stop_reason
