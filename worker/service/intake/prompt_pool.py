"""Tokenizing off the engine loop: admissions get their prompt ids on a small thread pool.

The intake hands every started admission here; a pool thread tokenizes (or renders the
chat template) and validates it with the engine's ``PromptBuilder``, then posts it to the
engine loop's mailbox, carrying either the token ids or the refusal. The loop then only
queues ready token ids: its per-step work no longer depends on how long a prompt's text is,
and a 400k-character prompt no longer stalls every running stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from protocol.models import GenerateRequest
from worker.engine import PromptError, PromptOptions
from worker.service.jobs import Admission

log = structlog.get_logger("ferry.worker.prompts")

BuildPrompt = Callable[[GenerateRequest, list[int]], list[int]]
"""(request, prior output ids) -> validated prompt token ids; raises ``PromptError``."""
Decode = Callable[[list[int]], str]
"""Token ids -> text (``echo`` of a prompt given as ids)."""


class PromptPool:
    def __init__(self, build: BuildPrompt, mailbox: queue.Queue[Any], workers: int = 2,
                 decode: Decode | None = None) -> None:
        self._build = build
        self._decode = decode
        self._mailbox = mailbox
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="ferry-prompts")
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def busy(self) -> bool:
        """Admissions are being prepared (the drain waits for them to reach the loop)."""
        with self._lock:
            return self._pending > 0

    def submit(self, admission: Admission) -> None:
        with self._lock:
            self._pending += 1
        self._executor.submit(self._prepare, admission)

    def _prepare(self, admission: Admission) -> None:
        try:
            request = admission.request
            admission.prompt_token_ids = self._build(request, admission.prior_token_ids)
            # echo of ids, or of a prompt cut to its last tokens: only the worker knows it
            decoded = request.prompt_token_ids is not None \
                or request.params.truncate_prompt_tokens is not None
            if request.echo and decoded and self._decode:
                admission.prompt_text = self._decode(admission.prompt_token_ids)
        except PromptError as exc:
            admission.error = exc
        except ValueError as exc:  # e.g. a chat template refusing the messages
            admission.error = PromptError(str(exc))
        except Exception as exc:  # a tokenizer bug fails the request, never the worker
            log.exception("prompt_build_failed", request_id=admission.request.request_id)
            admission.error = exc
        finally:
            with self._lock:
                self._pending -= 1
            admission.trace.prepared_at = time.time()
            self._mailbox.put(admission)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def build_with(prompts: Any) -> BuildPrompt:
    """A ``BuildPrompt`` over an engine's ``PromptBuilder``."""

    def build(request: GenerateRequest, prior: list[int]) -> list[int]:
        messages = [m.model_dump() for m in request.messages] if request.messages else None
        options = PromptOptions(
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs, suffix=request.suffix)
        return list(prompts.build(
            prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            messages=messages, params=request.params, prior_output_ids=prior,
            options=options,
        ))

    return build
