"""Answers to the gateway's tokenizer requests (``protocol/tokenizer.py``), computed with the
engine's ``PromptBuilder``: the same tokenizer and chat template that generation uses.

No Redis here (``tokenizer_responder.py`` moves the messages). The bodies are vLLM's:
``/tokenize`` -> ``{count, max_model_len, tokens, token_strs}``, ``/detokenize`` ->
``{prompt}``, ``/tokenizer_info`` -> the tokenizer's config (what ``tokenizer_config.json``
holds, minus file paths) with ``tokenizer_class`` and the ``chat_template``.
"""

from __future__ import annotations

from typing import Any

import structlog

from protocol.lora.paths import AdapterPathError, confine, scrub
from protocol.tokenizer import TokenizerReply, TokenizerRequest
from worker.engine import LoraError, LoraManager, PromptBuilder, PromptError, PromptOptions

_PRIVATE_CONFIG = frozenset({
    "vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local",
    "local_files_only", "cache_dir", "token", "_commit_hash",
})
"""Config entries that name files or directories of the worker's machine: not the
caller's business (vLLM drops the file paths too)."""
_INT64 = 2**63  # msgpack's integers end here
log = structlog.get_logger("ferry.worker.tokenizer")


def answer(request: TokenizerRequest, prompts: PromptBuilder, tokenizer: Any,
           lora: LoraManager | None = None) -> TokenizerReply:
    """The reply to one request; a refusal is a 400 naming the field, never an exception."""
    try:
        if request.op == "check_lora":
            return check_lora(request, lora)
        if request.op == "info":
            return TokenizerReply(status=200, body=tokenizer_info(tokenizer))
        if request.op == "detokenize":
            return TokenizerReply(status=200, body=_detokenize(request, prompts))
        return TokenizerReply(status=200, body=_tokenize(request, prompts))
    except PromptError as exc:
        return TokenizerReply(status=400, error=str(exc), param=exc.param)
    except (ValueError, TypeError) as exc:  # e.g. a chat template refusing the messages
        field = "messages" if request.messages is not None else "prompt"
        return TokenizerReply(status=400, error=f"{field}: {exc}", param=field)


def _tokenize(request: TokenizerRequest, prompts: PromptBuilder) -> dict[str, Any]:
    messages = None if request.messages is None else [
        m.model_dump() for m in request.messages]
    ids = prompts.tokenize(
        request.prompt, messages, PromptOptions(
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message),
        add_special_tokens=request.add_special_tokens)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": prompts.limits.max_model_len,
                            "tokens": ids}
    if request.return_token_strs:
        body["token_strs"] = prompts.token_strs(ids)
    return body


def _detokenize(request: TokenizerRequest, prompts: PromptBuilder) -> dict[str, Any]:
    ids = list(request.tokens or [])
    vocab = prompts.limits.vocab_size
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise PromptError(f"tokens.{i}: token id {token} outside [0, {vocab})",
                              param="tokens")
    return {"prompt": prompts.decode(ids)}


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's config as JSON values, as vLLM's ``/tokenizer_info`` answers: its
    init arguments (special tokens as their text), ``tokenizer_class``, ``chat_template``."""
    config = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in _PRIVATE_CONFIG}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            config[name] = str(value)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def _plain(value: Any) -> Any:
    """JSON-able and msgpack-able: an AddedToken as its text, maps with string keys, lists
    of such, integers past 64 bits as floats."""
    if hasattr(value, "content"):
        return str(value.content)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _INT64:
        return float(value)  # transformers' "no limit" model_max_length is int(1e30)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def check_lora(request: TokenizerRequest, lora: LoraManager | None) -> TokenizerReply:
    """Load the adapter at ``lora_path`` against this worker's base model without
    registering it (the gateway registers it fleet-wide when this says 200). The path is
    resolved and must lie inside the worker's adapter roots (``lora.roots``); every path
    refusal is the same sentence, and no answer holds a path."""
    if lora is None:
        return TokenizerReply(status=400, param="lora_name", error=(
            "LoRA is not enabled on this model's workers (FERRY_ENABLE_LORA=1 or "
            "FERRY_LORA_MODULES)"))
    given = request.lora_path or ""
    try:
        real = confine(given, lora.roots)
    except AdapterPathError as exc:
        return TokenizerReply(status=400, error=str(exc), param="lora_path")
    try:
        adapter = lora.load(request.lora_name or "adapter", real)
    except LoraError as exc:
        return TokenizerReply(status=400, error=scrub(str(exc), given, real),
                              param="lora_path")
    except Exception as exc:  # anything else a hostile file provokes: the request's 400
        log.warning("check_lora_failed", error=type(exc).__name__)
        return TokenizerReply(status=400, param="lora_path", error=(
            "lora_path: the adapter's files cannot be read as a LoRA adapter"))
    return TokenizerReply(status=200, body={"name": adapter.name, "rank": adapter.rank,
                                            "modules": sorted(adapter.weights)})
