"""A fake worker side for the gateway's LoRA tests: answers the ``check_lora`` tokenizer op
of one model (200 for a directory that exists, 400 otherwise), as a thread on real Redis.
The engine's real check is the worker's (worker/service/); here only the protocol counts."""

from __future__ import annotations

import os
import threading

import redis

from protocol.keys import Keys
from protocol.tokenizer import (
    REPLY_TTL_S,
    TokenizerReply,
    decode_tokenizer_request,
    encode_tokenizer_message,
)
from protocol.tokenizer_queue import BELL, POP_LUA, payload_of, pop_args

REFUSAL = "lora_path: the adapter's base model is not this worker's model"
CORRUPT = "CORRUPT"
"""A file of this name in an adapter's directory makes the check fail (a corrupt file)."""


class LoraChecker(threading.Thread):
    """BLPOPs ``Keys.tokenizer_requests(model)``'s bells and pops the calls until
    ``stop()``, as the worker's responder does; ``asked`` records the
    (name, path) of every check."""

    def __init__(self, url: str, model: str, keys: Keys | None = None) -> None:
        super().__init__(daemon=True, name=f"lora-checker-{model}")
        self.redis = redis.Redis.from_url(url)
        self.keys = keys or Keys()
        self.model = model
        self.asked: list[tuple[str | None, str | None]] = []
        self._stop_flag = threading.Event()

    def __enter__(self) -> LoraChecker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop_flag.set()
        self.join(timeout=5)
        self.redis.close()

    def run(self) -> None:
        queue = self.keys.tokenizer_requests(self.model)
        while not self._stop_flag.is_set():
            popped = self.redis.blpop([queue], timeout=0.2)
            if popped is None:
                continue
            data = popped[1]
            if data == BELL:  # the next call of the tenants in turn (tokenizer_queue.py)
                keys, args = pop_args(queue, small_only=False)
                raw = self.redis.eval(POP_LUA, len(keys), *keys, *args)
                if raw is None:
                    continue
                data = payload_of(raw)
            request = decode_tokenizer_request(data)
            if request.op != "check_lora":
                reply = TokenizerReply(status=400, error=f"op: {request.op} not faked")
            else:
                self.asked.append((request.lora_name, request.lora_path))
                reply = self._check(request.lora_name, request.lora_path)
            key = self.keys.tokenizer_reply(self.model, request.reply_id)
            pipe = self.redis.pipeline()
            pipe.rpush(key, encode_tokenizer_message(reply))
            pipe.expire(key, REPLY_TTL_S)
            pipe.execute()

    @staticmethod
    def _check(name: str | None, path: str | None) -> TokenizerReply:
        if path is None or not os.path.isdir(path):
            return TokenizerReply(status=400, error=REFUSAL, param="lora_path")
        if os.path.exists(os.path.join(path, CORRUPT)):
            return TokenizerReply(status=400, error="lora_path: adapter_model.safetensors "
                                  "is corrupt", param="lora_path")
        return TokenizerReply(status=200, body={"name": name, "rank": 8,
                                                "modules": ["q_proj", "v_proj"]})
