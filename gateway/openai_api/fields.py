"""Every OpenAI / vLLM request field Ferry does not map to a sampling parameter, and what
it does with it: refuse it unless it has a value that changes nothing, or ignore it
because it cannot change the output.

The rule (docs/protocol.md §8): no field that changes the output is silently ignored. A
field whose meaning Ferry cannot produce (tool calling, beam search, a request-supplied
chat template, ...) is a 400 naming it, unless its value is one that asks for nothing
(``tools: []``, ``use_beam_search: false``); so is a field honoured on one route only
(``suffix`` on completions, the chat template's switches on chat) sent to the other. A
field that cannot change the text (billing, storage, tracing, a backend choice) is
accepted and ignored. Fields Ferry honours are declared on the body models
(``gateway/openai_api/schemas.py``); anything else is unknown and ignored with a log line,
as OpenAI-compatible servers do. ``tests/gateway`` checks that
docs/protocol.md names every field listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import APIError

# field -> the values that ask for nothing (any other value is refused)
REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    # tool calling on /v1/completions (chat honours tools: gateway/openai_api/tools.py),
    # the legacy function-calling fields, and other OpenAI features
    "tools": (None, []),
    "functions": (None, []),
    "function_call": (None, "none"),
    "tool_choice": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    # vLLM sampling and prompt extras
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "return_token_ids": (None, False),
    "prompt_embeds": (None,),
    "structural_tag": (None,),
    "kv_transfer_params": (None, {}),
    "vllm_xargs": (None, {}),
    # vLLM chat template controls (the switches and kwargs are honoured: ROUTE_ONLY)
    "chat_template": (None,),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
}
# field -> (the one route that honours it, the values that ask for nothing): on the other
# route the field means nothing, and is refused unless harmless
ROUTE_ONLY: dict[str, tuple[str, tuple[Any, ...]]] = {
    "suffix": ("completions", (None, "")),  # fill-in-the-middle, where the model has FIM tokens
    "add_generation_prompt": ("chat", (None, True)),
    "continue_final_message": ("chat", (None, False)),
    "chat_template_kwargs": ("chat", (None, {})),
}
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# add_special_tokens: vLLM's default differs by route; only the default is possible
ADD_SPECIAL_TOKENS_DEFAULT = {"completions": True, "chat": False}

# fields that cannot change the output: accepted and ignored
IGNORED: dict[str, str] = {
    "user": "end-user id, for abuse monitoring",
    "metadata": "stored-completion tags",
    "store": "OpenAI's stored completions",
    "service_tier": "OpenAI's billing tier",
    "prompt_cache_key": "OpenAI's cache routing hint",
    "safety_identifier": "end-user id, for abuse monitoring",
    "parallel_tool_calls": "completions: meaningful only with tools (refused there)",
    "include_reasoning": "vLLM: reasoning parser output (none here)",
    "guided_decoding_backend": "vLLM: which grammar engine (llguidance here)",
}


def refuse_unsupported(extra: Mapping[str, Any], route: str) -> list[str]:
    """400 naming the first field whose value asks for something Ferry cannot do; returns
    the names of unknown fields (to log)."""
    for name, harmless in REFUSED_UNLESS.items():
        if name in extra and not any(_same(extra[name], h) for h in harmless):
            raise APIError(400, f"{name}: not supported by this server", param=name)
    for name, (honoured, harmless) in ROUTE_ONLY.items():
        if route != honoured and name in extra \
                and not any(_same(extra[name], h) for h in harmless):
            raise APIError(400, f"{name}: only for {_PATHS[honoured]}", param=name)
    if "add_special_tokens" in extra and not _same(
            extra["add_special_tokens"], ADD_SPECIAL_TOKENS_DEFAULT[route]):
        raise APIError(400, "add_special_tokens: only the default "
                       f"({str(ADD_SPECIAL_TOKENS_DEFAULT[route]).lower()}) is supported",
                       param="add_special_tokens")
    known = REFUSED_UNLESS.keys() | ROUTE_ONLY.keys() | IGNORED.keys() | {"add_special_tokens"}
    return sorted(name for name in extra if name not in known)


def _same(value: Any, harmless: Any) -> bool:
    """Equal, and of the same JSON type (``1`` is not ``true``)."""
    if isinstance(value, bool) or isinstance(harmless, bool):
        return value is harmless
    return bool(value == harmless)
