"""Tools and tool turns in a chat prompt: through the model's template, or Ferry's fallback.

A template that knows tools (it reads a ``tools`` variable: Qwen, Hermes, Llama 3.1+,
Mistral) gets them as ``apply_chat_template(tools=...)`` does, and assistant calls and
``tool`` turns as transformers documents them (arguments as an object). A template that
knows none (the default model's) would drop all of it silently; it gets the tools
described in the system message and calls written in the ``hermes`` syntax (the one the
grammar then enforces, ``protocol/structured/tool_syntax.py``), so the history reads as the model is
asked to write. docs/tools.md shows the fallback's text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protocol.structured.tool_syntax import FAMILIES
from protocol.structured.tools import ToolCall

FALLBACK_INTRO = (
    "You can call functions. Their signatures, as JSON, are between <tools> and </tools>:"
)
FALLBACK_HOWTO = (
    "To call a function, answer with one block per call, and nothing else:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
    "</tool_call>\nOtherwise answer in plain text."
)


def knows_tools(template: Any) -> bool:
    """Whether a chat template renders a ``tools`` variable."""
    text = template if isinstance(template, str) else json.dumps(template or "")
    return "tools" in text


def template_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
    native: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the template: natively, or with the fallback's text."""
    cleaned = [_clean(m) for m in messages]
    if native:
        return cleaned, list(tools) if tools else None
    out = [_inline(m) for m in cleaned]
    if tools:
        system = _fallback_system(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    """Null tool fields left out; calls in the template's shape."""
    out = {k: v for k, v in message.items()
           if v is not None and k not in ("tool_calls",)}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [c if "function" in c else ToolCall(**c).template_dict()
                             for c in calls]
    return out


def _inline(message: dict[str, Any]) -> dict[str, Any]:
    """A turn with calls as plain text in the hermes syntax (the fallback)."""
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message.get("content") or ""}
    fam = FAMILIES["hermes"]
    blocks = fam.sep.join(
        fam.call_open + json.dumps({"name": c["function"]["name"],
                                    "arguments": c["function"]["arguments"]},
                                   ensure_ascii=False) + fam.call_close
        for c in calls)
    content = message.get("content") or ""
    return {"role": message["role"], "content": f"{content}\n{blocks}" if content else blocks}


def _fallback_system(tools: Sequence[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{FALLBACK_INTRO}\n<tools>\n{listed}\n</tools>\n{FALLBACK_HOWTO}"
