"""How a request enters the engine: tokenized and validated, then queued as one engine
request per candidate (``n > 1``, ``best_of``), each with its stream opened.

A mixin of ``Engine`` (it reads the engine's prompt builder, LoRA adapters, scheduler,
streams, candidate groups, grammars and prompt scoring), apart from the step loop as
``request_ends.py`` is: requests come in here and leave there, the step is ``engine.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol.sampling import SamplingParams
from worker.engine.choices import candidate_id, candidate_params
from worker.engine.inputs.prompts import PromptOptions
from worker.engine.lora.engine_hooks import adapter_for
from worker.engine.request import Request

if TYPE_CHECKING:
    from worker.engine.choices import CandidateGroups
    from worker.engine.inputs.prompts import PromptBuilder
    from worker.engine.lora.manager import LoraManager
    from worker.engine.output.step_batch import StreamRegistry
    from worker.engine.runner.model_runner import ModelRunner
    from worker.engine.sample.prompt_logprobs import PromptScoring
    from worker.engine.sched.scheduler import Scheduler
    from worker.engine.structured.decoding import StructuredOutputs


class RequestAdds:
    runner: ModelRunner
    prompts: PromptBuilder
    lora: LoraManager | None
    scheduler: Scheduler
    streams: StreamRegistry
    structured: StructuredOutputs
    scoring: PromptScoring
    _groups: CandidateGroups

    def add_request(
        self, request_id: str, prompt: str | list[int] | None = None,
        params: SamplingParams | dict[str, Any] | None = None, *,
        messages: list[dict[str, Any]] | None = None, priority: int = 0,
        prior_output_ids: list[int] | None = None, options: PromptOptions | None = None,
        lora_name: str | None = None, cache_scope: str | None = None,
    ) -> Request:
        """Tokenize, validate and queue a request; raises ValueError naming the problem
        (``UnknownAdapter``, a ValueError, for a ``lora_name`` not loaded).
        ``cache_scope``: the prefix-cache partition it may share blocks with (None: the
        default one), ``Request.cache_scope``.

        ``prior_output_ids`` resumes a request whose first tokens were already produced
        (and sent) elsewhere: generation continues after them.
        """
        lora = adapter_for(self.lora, lora_name)  # before any work: an unknown name fails
        params = SamplingParams.coerce(params)
        ids = self.prompts.build(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt if isinstance(prompt, list) else None,
            messages=messages, params=params, prior_output_ids=prior_output_ids,
            options=options,
        )
        return self.add_tokens(request_id, ids, params, priority=priority,
                               prior_output_ids=prior_output_ids, lora=lora,
                               cache_scope=cache_scope)

    def add_tokens(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        priority: int = 0, prior_output_ids: list[int] | None = None,
        prior_by_choice: dict[int, list[int]] | None = None,
        skip_choices: frozenset[int] = frozenset(), lora: Any = None,
        cache_scope: str | None = None,
    ) -> Request:
        """Queue a prompt that ``self.prompts.build`` already tokenized and validated (on
        any thread), so the engine loop's cost does not depend on the prompt's text size.

        With ``n > 1`` or ``best_of``, one engine request per candidate (``choices.py``);
        a resumed request gives each candidate's tokens so far (``prior_by_choice``) and the
        candidates that had already finished (``skip_choices``). Returns the first queued.
        """
        params = self.prompts.fit(params, len(prompt_token_ids))
        count = params.num_candidates
        priors = prior_by_choice if prior_by_choice is not None else \
            {0: list(prior_output_ids or [])}
        first: Request | None = None
        for index in range(count):
            if index in skip_choices:
                continue
            request = self._add_one(
                candidate_id(request_id, index, count), prompt_token_ids,
                candidate_params(params, index) if count > 1 else params, priority,
                list(priors.get(index, [])), lora, cache_scope,
            )
            if count > 1:
                request.parent_id, request.index = request_id, index
                request.report_logprobs = params.logprobs is not None
                self._groups.add(request_id, request.request_id)
            self.streams.open(request)  # after its parent id and index are known
            first = first or request
        if first is None:
            raise ValueError("skip_choices: every candidate has already finished")
        return first

    def _add_one(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int, prior: list[int], lora: Any = None, cache_scope: str | None = None,
    ) -> Request:
        request = Request(
            request_id, prompt_token_ids, params,
            eos_token_ids=self.runner.loaded.eos_token_ids, priority=priority,
            output_token_ids=prior, bad_words_ids=self.prompts.bad_words_ids(params),
            lora=lora, cache_scope=cache_scope,
        )
        self.structured.attach(request)  # [structured output] compile starts off the loop
        self.scoring.add(request)
        self.scheduler.add(request)
        return request
