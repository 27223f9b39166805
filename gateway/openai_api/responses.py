"""OpenAI's Responses API (``/v1/responses``), stateless, mapped onto chat completions.

A Responses body becomes a chat body (``to_chat_body``): ``instructions`` a system turn,
``input`` a string or a list of items (messages, the model's earlier ``function_call``
items, the client's ``function_call_output`` items), function ``tools``, ``tool_choice``,
``text.format`` a ``response_format``; from there it is a chat request like any other
(the same tool grammar, queue and worker). Nothing is stored: ``store: true``,
``previous_response_id``, ``conversation`` and ``background`` are refused by name, so a
client never believes a response was kept. ``response_body`` turns a chat completion
back into a Response object. docs/tools.md.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gateway.errors import APIError

REFUSED = {
    "previous_response_id": "responses are not stored by this server (stateless): send "
                            "the whole conversation as input",
    "conversation": "conversations are not stored by this server (stateless)",
    "prompt": "stored prompt templates are not supported",
}
PASSED = ("temperature", "top_p", "parallel_tool_calls", "stream", "seed", "model",
          "user", "metadata", "service_tier", "cache_salt")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body means; 400 naming what cannot be."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise APIError(400, f"{name}: {why}", param=name)
    if body.get("store") is True:
        raise APIError(400, "store: responses are not stored by this server (stateless); "
                       "send store: false", param="store")
    if body.get("background") is True:
        raise APIError(400, "background: not supported", param="background")
    if body.get("top_logprobs"):
        raise APIError(400, "top_logprobs: not supported on /v1/responses",
                       param="top_logprobs")
    chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat.pop("metadata", None)
    chat.pop("service_tier", None)
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text(body["instructions"],
                                                              "instructions")})
    messages += _messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(i, t) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: only a function may be named "
                           '({"type": "function", "name": ...})', param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) \
        else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _text(value: Any, param: str) -> str:
    """A string, or the text of a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise APIError(400, f"{param}.{i}.type: only text parts are supported, got "
                               f"{kind!r}", param=f"{param}.{i}.type")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise APIError(400, f"{param}: must be a string or a list of text parts", param=param)


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input: required, a string or a list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input.{i}: must be an object", param=f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input.{i}.role: unknown role {role!r}",
                               param=f"input.{i}.role")
            out.append({"role": role, "content": _text(item.get("content", ""),
                                                       f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "{}")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else _text(output, f"input.{i}.output")})
        elif kind == "reasoning":
            continue  # no reasoning here to replay
        else:
            raise APIError(400, f"input.{i}.type: {kind!r} items are not supported",
                           param=f"input.{i}.type")
    return out


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"tools.{i}.type: only function tools are supported, got "
                       f"{kind!r}", param=f"tools.{i}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def response_body(chat: dict[str, Any], body: dict[str, Any], resp_id: str,
                  created: float | None = None) -> dict[str, Any]:
    """A Response object from a chat completion body (its first choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(call_item(call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    usage = chat.get("usage") or {}
    return envelope(body, resp_id, output, created, choice.get("finish_reason"),
                    usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call",
            "status": status, "call_id": call_id, "name": name, "arguments": arguments}


def envelope(body: dict[str, Any], resp_id: str, output: list[dict[str, Any]],
             created: float | None, finish: str | None, prompt: int,
             completion: int, cached: int = 0) -> dict[str, Any]:
    """The Response object around ``output``; ``finish`` None: still in progress.
    ``cached``: the prompt tokens the prefix cache served (the caller's own)."""
    status = "in_progress" if finish is None else \
        "incomplete" if finish == "length" else "completed"
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) \
        else None
    return {
        "id": resp_id, "object": "response", "created_at": int(created or time.time()),
        "status": status, "model": body.get("model") or "", "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "max_output_tokens": body.get("max_output_tokens"), "store": False,
        "text": {"format": fmt or {"type": "text"}}, "truncation": "disabled",
        "usage": None if finish is None else {
            "input_tokens": prompt, "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }
