"""Prompts -> validated token ids, callable from any thread (the service's intake pool).

Tokenizing a long prompt takes about a second per 700k characters; on the engine loop that
stalled every running stream (an adversarial probe measured a 3 s gap between tokens of an
unrelated request). So the worker service builds prompts off the loop and hands the engine
finished token ids. Each thread gets its own copy of the tokenizer: Hugging Face tokenizers
keep mutable state (truncation/padding settings) that must not be shared across threads.

A prompt that is certainly too long is refused before it is tokenized at all: no token of
this tokenizer is longer than ``max_token_chars`` characters, so a text of ``n`` characters
has at least ``n / max_token_chars`` tokens. Far over the context (4x), that lower bound is
reported instead of an exact count; closer to it, the exact count is reported.

Beyond the text, a request shapes its prompt as vLLM's do (``PromptOptions``): the chat
template's switches and extra variables, fill-in-the-middle around a ``suffix`` (only for a
tokenizer with FIM tokens; anything else is a refusal naming ``suffix``), and
``truncate_prompt_tokens`` (the last k tokens, whatever the prompt was given as).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.sampling import SamplingParams
from worker.engine.inputs.bad_words import BadWords
from worker.engine.inputs.tool_prompts import knows_tools, template_messages

_BOUND_MARGIN = 4  # refuse by the cheap bound only when it exceeds the context this much
FIM_TOKENS = (  # (prefix, suffix, middle): prefix-suffix-middle order, as these models train
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
     "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek-Coder
)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code


class PromptError(ValueError):
    """A prompt the engine cannot run; the message names the field.

    ``num_prompt_tokens`` is the prompt's length in tokens where it is known (reported in
    the usage of the refusal), or a lower bound when ``exact`` is False. ``param`` is the
    request field at fault and ``code`` OpenAI's error code, where one applies.
    """

    def __init__(self, message: str, num_prompt_tokens: int = 0, exact: bool = True,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens
        self.exact = exact
        self.param = param or message.split(":", 1)[0].split(".")[0] or None
        self.code = code


def context_error(field: str, context: int, prompt: int, max_tokens: int | None,
                  exact: bool = True) -> PromptError:
    """OpenAI's context-overflow refusal, word for word where clients match on it (LiteLLM
    maps "This model's maximum context length is" to ContextWindowExceededError).
    ``max_tokens`` None: the prompt alone leaves no room to generate."""
    noun = "messages" if field == "messages" else "prompt"
    count = str(prompt) if exact else f"at least {prompt}"
    if max_tokens is None:
        message = (f"This model's maximum context length is {context} tokens. However, your "
                   f"{noun} resulted in {count} tokens. Please reduce the length of the "
                   f"{noun}.")
    else:
        message = (f"This model's maximum context length is {context} tokens. However, you "
                   f"requested {prompt + max_tokens} tokens ({count} in the {noun}, "
                   f"{max_tokens} in the completion). Please reduce the length of the "
                   f"{noun} or completion.")
    return PromptError(message, prompt, exact, param=field, code=CONTEXT_LENGTH_EXCEEDED)


@dataclass(frozen=True)
class PromptOptions:
    """How a request's prompt is built beyond its text (GenerateRequest's prompt controls)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    tools: Sequence[Mapping[str, Any]] | None = None  # the template's ``tools`` (OpenAI shape)


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit: the model's vocabulary and context, and the KV pool."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int


class PromptBuilder:
    """``build(...)`` -> validated prompt token ids; thread-safe."""

    def __init__(self, tokenizer: Any, limits: PromptLimits) -> None:
        self._template = tokenizer
        self.limits = limits
        self._local = threading.local()
        self._local.tokenizer = tokenizer  # the constructing thread uses the original
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max((len(t) for t in vocab), default=0) or 0
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self.fim = next((t for t in FIM_TOKENS if all(x in added for x in t)), None)
        self.bad_words = BadWords(limits.vocab_size)

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self._template)
        return tok

    def build(
        self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None, params: SamplingParams | None = None,
        prior_output_ids: list[int] | None = None, options: PromptOptions | None = None,
    ) -> list[int]:
        """Tokenize (or chat-template), truncate and validate; raises ``PromptError``
        naming the field."""
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise PromptError("prompt: give exactly one of prompt, prompt_token_ids, messages")
        params = params or SamplingParams()
        options = options or PromptOptions()
        field = "messages" if messages is not None else \
            "prompt" if prompt is not None else "prompt_token_ids"
        if options.suffix and prompt is None:
            raise PromptError("suffix: only for a text prompt (fill-in-the-middle)")
        spec = params.structured_output
        if spec is not None and spec.tools is not None and options.tools is None:
            options = dataclasses.replace(
                options, tools=[t.template_dict() for t in spec.tools.tools])
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            if params.truncate_prompt_tokens is None:  # else cut, not refused
                self._refuse_by_bound(prompt, messages, params, options.suffix)
            ids = self.tokenize(prompt, messages, options)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            ids = ids[-(self.limits.max_model_len if keep == -1 else keep):]
        self.validate(ids, list(prior_output_ids or []), params, field)
        try:  # validated here, off the loop; the engine finds them cached
            self.bad_words.token_ids(self._tokenizer(), params.bad_words)
        except ValueError as exc:
            raise PromptError(str(exc), len(ids)) from None
        return ids

    def bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The token sequences ``params.bad_words`` bans (``bad_words.py``)."""
        return self.bad_words.token_ids(self._tokenizer(), params.bad_words)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` as the model's tokenizer writes it (``echo``)."""
        return str(self._tokenizer().decode(ids))

    def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                 options: PromptOptions | None = None, *,
                 add_special_tokens: bool | None = None) -> list[int]:
        """The prompt's ids, or the chat template's rendering of ``messages``.
        ``add_special_tokens`` (``/tokenize`` may ask, as vLLM's does) None: a prompt gets
        them, a chat only what its template writes; true on a chat adds them on top."""
        tok = self._tokenizer()
        options = options or PromptOptions()
        if messages is not None:
            return self._render_chat(tok, messages, options, bool(add_special_tokens))
        if options.suffix:
            prompt = self._fill_in_the_middle(str(prompt), options.suffix)
        special = True if add_special_tokens is None else add_special_tokens
        return list(tok(prompt, add_special_tokens=special, verbose=False)["input_ids"])

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (vLLM's ``return_token_strs``)."""
        return [str(t) for t in self._tokenizer().convert_ids_to_tokens(ids)]

    def _render_chat(self, tok: Any, messages: list[dict[str, Any]],
                     options: PromptOptions, add_special_tokens: bool = False) -> list[int]:
        """The model's chat template, with the request's switches and variables; a
        template that refuses them (``raise_exception``, a bad variable) is their fault."""
        import jinja2

        template = getattr(tok, "chat_template", None)
        if not template:
            raise PromptError("messages: this model has no chat template")
        tools = [dict(t) for t in options.tools] if options.tools else None
        messages, tools = template_messages(messages, tools, knows_tools(template))
        extra = {"tools": tools} if tools else {}
        try:
            rendered = tok.apply_chat_template(
                messages, **extra, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=not add_special_tokens, return_dict=False,
                **dict(options.chat_template_kwargs or {}))
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise PromptError(f"messages: the chat template refused them "
                              f"({type(exc).__name__}: {exc})") from None
        if add_special_tokens:  # the template's text, tokenized with special tokens on top
            return list(tok(rendered, add_special_tokens=True, verbose=False)["input_ids"])
        return list(rendered)

    def _fill_in_the_middle(self, prompt: str, suffix: str) -> str:
        """The prompt in prefix-suffix-middle order around the model's FIM tokens."""
        if self.fim is None:
            raise PromptError("suffix: this model has no fill-in-the-middle tokens (such as "
                              "<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), so it cannot "
                              "complete text before a suffix")
        prefix_token, suffix_token, middle_token = self.fim
        return f"{prefix_token}{prompt}{suffix_token}{suffix}{middle_token}"

    def _refuse_by_bound(
        self, prompt: str | None, messages: list[dict[str, Any]] | None, params: SamplingParams,
        suffix: str | None = None,
    ) -> None:
        if self.max_token_chars <= 0:
            return
        chars = len(prompt) + len(suffix or "") if prompt is not None else sum(
            len(str(m.get("content") or "")) for m in messages or [])
        at_least = -(-chars // self.max_token_chars)
        room = self.limits.max_model_len - (1 if params.fit_to_context else params.max_tokens)
        if at_least > _BOUND_MARGIN * max(room, 1):
            field = "prompt" if prompt is not None else "messages"
            raise context_error(field, self.limits.max_model_len, at_least,
                                None if params.fit_to_context else params.max_tokens,
                                exact=False)

    @property
    def capacity(self) -> int:
        """Tokens one request may hold: the context, or the whole KV pool if smaller."""
        return min(self.limits.max_model_len, self.limits.num_blocks * self.limits.block_size)

    def fit(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """``params`` with ``max_tokens`` cut to what the context leaves, for a request
        that asked for it (``fit_to_context``) and needs it; ``validate`` came first."""
        room = self.capacity - num_prompt_tokens
        if not params.fit_to_context or params.max_tokens <= room:
            return params
        return params.model_copy(update={"max_tokens": room,
                                         "min_tokens": min(params.min_tokens, room)})

    def validate(self, ids: list[int], prior: list[int], params: SamplingParams,
                 field: str = "prompt") -> None:
        limits = self.limits
        if not ids:
            raise PromptError("prompt: must not be empty")
        bad = next((t for t in ids + prior if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise PromptError(
                f"prompt_token_ids: token id {bad} outside [0, {limits.vocab_size})", len(ids))
        for name, tokens in (("logit_bias", params.logit_bias or {}),
                             ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = next((t for t in tokens if t >= limits.vocab_size), None)
            if bad is not None:
                raise PromptError(
                    f"{name}: token id {bad} outside [0, {limits.vocab_size})", len(ids))
        if params.fit_to_context and len(ids) < self.capacity:
            params = self.fit(params, len(ids))
        total = len(ids) + params.max_tokens
        if total > limits.max_model_len:
            raise context_error(field, limits.max_model_len, len(ids),
                                None if params.fit_to_context else params.max_tokens)
        if len(prior) >= params.max_tokens:
            raise PromptError("prior_output_ids: already has max_tokens tokens", len(ids))
        need = -(-total // limits.block_size)
        if need > limits.num_blocks:
            raise PromptError(
                f"max_tokens: the request needs {need} KV blocks but the pool has "
                f"{limits.num_blocks}", len(ids))
