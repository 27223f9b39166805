"""The messages that cross Redis, as pydantic models.

Everything a producer (gateway, any Python service) and a consumer (worker) exchange is
declared here once, so both sides validate against the same rules: the shared vocabulary
and the version (``wire.py``), what producers send (``request.py``) and what workers write
back (``results.py``). Import them from ``protocol.models``; the rooms may move behind it.
"""

from protocol.models.request import Cancel, ChatMessage, GenerateRequest
from protocol.models.results import (
    ChoiceResult,
    JobStatus,
    PromptLogprob,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerHeartbeat,
)
from protocol.models.wire import (
    ID_PATTERN,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    TERMINAL_STATES,
    WIRE_ID_PATTERN,
    ErrorKind,
    FinishReason,
    JobState,
    StopReason,
    new_request_id,
    state_for_finish,
)
from protocol.sampling import SamplingParams  # a request's ``params``

__all__ = [
    "ID_PATTERN",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "TERMINAL_STATES",
    "WIRE_ID_PATTERN",
    "Cancel",
    "ChatMessage",
    "ChoiceResult",
    "ErrorKind",
    "FinishReason",
    "GenerateRequest",
    "JobState",
    "JobStatus",
    "PromptLogprob",
    "SamplingParams",
    "StopReason",
    "Timings",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "WorkerHeartbeat",
    "new_request_id",
    "state_for_finish",
]
