"""Ferry wire protocol: torch-free models, codec, key names and a client.

See ``docs/protocol.md`` for the contract written for services in other languages.
"""

from protocol.codec import (
    ProtocolError,
    decode_cancel,
    decode_entry,
    decode_event,
    decode_heartbeat,
    decode_request,
    encode_cancel,
    encode_event,
    encode_heartbeat,
    encode_request,
)
from protocol.keys import Keys
from protocol.models import (
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    GenerateRequest,
    JobStatus,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
)
from protocol.sampling import SamplingParams
from protocol.store import DuplicateRequestError, Ttls
from protocol.streaming import StreamTimeout

__all__ = [
    "PROTOCOL_VERSION",
    "Cancel",
    "ChatMessage",
    "DuplicateRequestError",
    "GenerateRequest",
    "JobStatus",
    "Keys",
    "ProtocolError",
    "SamplingParams",
    "StreamTimeout",
    "TokenEvent",
    "Ttls",
    "Usage",
    "WorkerHeartbeat",
    "decode_cancel",
    "decode_entry",
    "decode_event",
    "decode_heartbeat",
    "decode_request",
    "encode_cancel",
    "encode_event",
    "encode_heartbeat",
    "encode_request",
]
