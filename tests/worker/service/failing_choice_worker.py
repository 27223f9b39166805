"""``python -m tests.worker.service.failing_choice_worker worker ...``: the real ``ferry
worker`` command, except that candidate 1 of a request whose id starts with ``failchoice``
fails (``finish_reason`` error) once it has ``FERRY_TEST_FAIL_AFTER_TOKENS`` tokens, as a
grammar that dead-ends fails one candidate of several. Only the failure is simulated: the
rows go through the engine's per-row update (the requests ask for logprobs), and the
siblings' abort, the events and the Redis writes are the production ones.
"""

from __future__ import annotations

import os

from ferry.cli import main
from worker.engine.request import FinishReason, Request
from worker.engine.structured.decoding import StructuredOutputs

_AFTER = int(os.environ.get("FERRY_TEST_FAIL_AFTER_TOKENS", "4"))
_advance = StructuredOutputs.advance


def _failing_advance(self: StructuredOutputs, request: Request
                     ) -> tuple[FinishReason, str | None] | None:
    if (request.request_id.startswith("failchoice") and request.request_id.endswith("#1")
            and request.num_output_tokens >= _AFTER and not request.is_finished):
        return FinishReason.ERROR, "simulated candidate failure"
    return _advance(self, request)


StructuredOutputs.advance = _failing_advance  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
