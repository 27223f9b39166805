"""Sampling parameters: one model shared by the wire protocol, the gateway and the engine.

Field names and defaults follow vLLM's ``SamplingParams`` so its users need nothing new.
Validation happens here, once, so that a bad value is refused with the field named before
the request reaches a worker, let alone a GPU.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from protocol.structured.constraint import StructuredOutput

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024
MAX_N = 128  # the wire's bound on n and best_of; the gateway's own limit is lower (16)
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 2**18  # more than any vocabulary Ferry serves


class SamplingParams(BaseModel):
    """How to pick each next token, and when to stop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=16, ge=1, description="Tokens to generate at most.")
    fit_to_context: bool = Field(
        default=False, description="If prompt + max_tokens exceeds the model's context, "
        "generate what the context leaves instead of refusing (OpenAI's absent max_tokens).")
    min_tokens: int = Field(default=0, ge=0, description="EOS and stop ids are ignored before.")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: int = Field(default=0, ge=-1, description="Keep the k likeliest; 0 or -1: off.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass to keep.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop p < min_p * p_max.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(
        default=None, ge=0, lt=2**63, description="Per-request seed: same tokens in any batch."
    )
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="Logprob of every prompt token (and this many alternatives), as vLLM.")
    logit_bias: dict[int, float] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS,
        description="Token id -> bias in [-100, 100] added to its logit (OpenAI's meaning).",
    )

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        """OpenAI sends token ids as JSON object keys (strings), and msgpack maps on the
        wire carry string keys too: accept decimal strings, keep ints inside."""
        if not isinstance(value, dict):
            return value
        out: dict[Any, Any] = {}
        for key, bias in value.items():
            if isinstance(key, str):
                if not key.strip().isdigit():
                    raise ValueError(f"logit_bias: key {key!r} is not a token id")
                key = int(key)
            out[key] = bias
        return out

    @field_serializer("logit_bias")
    def _string_keys(self, value: dict[int, float] | None) -> dict[str, float] | None:
        return None if value is None else {str(k): v for k, v in value.items()}
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, lt=2**31,
        description="Keep only the prompt's last k tokens (k >= 1); -1: as many as the "
        "model's context holds (vLLM's meaning). Applied by the worker after tokenizing.")
    bad_words: list[str] | None = Field(
        default=None, max_length=MAX_BAD_WORDS,
        description="Words never generated: each word's tokens (with and without a leading "
        "space) are banned, a multi-token word's last token only after the others (vLLM).")
    allowed_token_ids: list[int] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
        description="Only these tokens may be generated (ids checked against the vocabulary "
        "by the worker).")
    # [structured output] the one constraint the text must follow
    # (protocol/structured/constraint.py)
    structured_output: StructuredOutput | None = None
    n: int = Field(default=1, ge=1, le=MAX_N, description="Choices returned per request.")
    best_of: int | None = Field(
        default=None, ge=1, le=MAX_N,
        description="Candidates generated; the n with the highest cumulative logprob are "
        "returned (not streamable).",
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> SamplingParams:
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        self._check_prompt_and_token_fields()
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must not exceed max_tokens")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} must be >= 0")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: bias {bias} for token {token} is outside "
                                 "[-100, 100]")
        return self

    def _check_prompt_and_token_fields(self) -> None:
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be an integer >= 1 or -1, got 0")
        for i, word in enumerate(self.bad_words or []):
            if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words: word {i} must have 1 to {MAX_BAD_WORD_CHARS} "
                                 "characters, not only spaces")
        if any(t < 0 for t in self.allowed_token_ids or []):
            raise ValueError("allowed_token_ids: token ids must be >= 0")

    @classmethod
    def coerce(cls, params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """``params`` as given to the engine's API: None (the defaults), a dict, or one."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, dict):
            return cls(**params)  # pydantic's ValidationError is a ValueError
        raise TypeError(f"params must be SamplingParams or dict, not {type(params).__name__}")

    @property
    def num_candidates(self) -> int:
        """Sequences generated for the request: ``best_of`` if given, else ``n``."""
        return self.best_of or self.n

    @property
    def ranks_candidates(self) -> bool:
        """More candidates than choices: the best ``n`` are picked at the end."""
        return self.num_candidates > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def wants_penalties(self) -> bool:
        """Any repetition, presence or frequency penalty (they read the token history)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
