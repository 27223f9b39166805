"""The chat-template controls a request may carry: which extra arguments reach the
template's render (``chat_template_kwargs``) and which names stay Ferry's own.

A template reads ``chat_template_kwargs`` as variables (Qwen3's ``enable_thinking``,
a date, a persona). The worker passes them to ``tokenizer.apply_chat_template`` next to
its own arguments, so a key that names one of those (``tokenize``, ``messages``, the
generation-prompt switches, the tokenizer's special tokens, which transformers lets
kwargs override) would change what Ferry controls: such keys are refused, as are maps
too large to be template variables. Torch-free: the gateway and any producer check the
same rules the worker relies on.
"""

from __future__ import annotations

import json
from typing import Any

MAX_TEMPLATE_KWARGS = 64
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024  # as compact JSON
MAX_TEMPLATE_KWARG_NAME = 128

RESERVED_TEMPLATE_KWARGS = frozenset({
    # apply_chat_template's own parameters
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
    # what the template itself is given
    "messages",
    # special tokens: transformers lets kwargs override them
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token", "additional_special_tokens",
})


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` (``"chat_template_kwargs: ..."``) for a map the worker must not
    pass to the template: too many keys, too large, a bad or reserved key, or a value JSON
    cannot carry."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs: {len(kwargs)} keys exceed the limit of "
                         f"{MAX_TEMPLATE_KWARGS}")
    for key in kwargs:
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_TEMPLATE_KWARG_NAME:
            raise ValueError(f"chat_template_kwargs: key {str(key)[:40]!r} must be a string "
                             f"of 1 to {MAX_TEMPLATE_KWARG_NAME} characters")
        if key in RESERVED_TEMPLATE_KWARGS:
            hint = " (use the request field of that name)" \
                if key in ("add_generation_prompt", "continue_final_message") else ""
            raise ValueError(f"chat_template_kwargs: {key!r} is set by the server and cannot "
                             f"be overridden{hint}")
    try:
        size = len(json.dumps(kwargs, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"chat_template_kwargs: not a JSON object ({exc})") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs: {size} bytes as JSON exceed the limit of "
                         f"{MAX_TEMPLATE_KWARGS_BYTES}")
