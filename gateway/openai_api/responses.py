"""OpenAI's Responses API (``/v1/responses``), stateless, mapped onto chat completions.

A Responses body becomes a chat body (``to_chat_body``): ``instructions`` a system turn,
``input`` a string or a list of items (messages, the model's earlier ``function_call``
items, the client's ``function_call_output`` items), function ``tools``, ``tool_choice``,
``text.format`` a ``response_format``; from there it is a chat request like any other
(the same tool grammar, queue and worker). The body is typed and checked first
(``gateway/openai_api/responses_body.py``): nothing is stored, so ``store: true``,
``previous_response_id``, ``conversation`` and ``background`` are refused by name, and a
client never believes a response was kept; the chat route's errors are renamed to the
Responses fields (``ChatBody.translate``). ``response_body`` turns a chat completion
back into a Response object, with the text's logprobs when ``include`` asks. docs/tools.md.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.body import validate
from gateway.errors import APIError
from gateway.openai_api.responses_body import (
    AllowedToolsChoice,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
    Text,
    ToolIn,
)
from protocol.structured.tool_syntax import whole_arguments
from protocol.values import first_path, unencodable

log = structlog.get_logger("ferry.gateway")
PASSED = ("temperature", "top_p", "parallel_tool_calls", "stream", "seed", "model", "user",
          "cache_salt")
# a chat body's field -> the Responses body's (the chat route's errors, renamed)
_RENAMES = (
    (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function(?=\.|$)"), r"tools.\1"),
    (re.compile(r"^tool_choice\.allowed_tools\.tools\.(\d+)\.function"),
     r"tool_choice.tools.\1"),
    (re.compile(r"^tool_choice\.function(?=\.)"), "tool_choice"),
)
_MESSAGE = re.compile(r"^messages(\.(\d+))?(\.[\w.]+)?")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ChatBody:
    """A Responses body as a chat body, and where each chat message came from, so the
    chat route's errors name the Responses field (``max_output_tokens``, ``input.3``)."""

    request: ResponsesRequest
    chat: dict[str, Any]
    sources: list[str] = field(default_factory=list)  # per chat message: its field

    def param(self, param: str | None) -> str | None:
        if param is None:
            return None
        found = _MESSAGE.match(param)
        if found:
            index = found.group(2)
            return self.sources[int(index)] if index is not None \
                and int(index) < len(self.sources) else "input"
        for pattern, name in _RENAMES:
            param = pattern.sub(name, param)
        return param

    def translate(self, error: APIError) -> APIError:
        """``error`` with its field named as the Responses body names it."""
        param = self.param(error.param)
        if param == error.param:
            return error
        message = error.message
        if error.param and message.startswith(error.param):
            message = str(param) + message[len(error.param):]
        return APIError(error.status, message, param=param, type_=error.type,
                        headers=error.headers, code=error.code)


def to_chat_body(body: dict[str, Any]) -> ChatBody:
    """The chat completions body a Responses body means; 400 naming what cannot be."""
    broken = first_path(body, unencodable)  # every field is echoed in the Response
    if broken:
        raise APIError(400, f"{broken}: not valid Unicode text (a lone surrogate?)",
                       param=broken.split(" ")[0])
    request = validate(ResponsesRequest, body)
    request.check()
    if request.model_extra:
        log.info("request_fields_ignored", fields=sorted(request.model_extra)[:20])
    chat: dict[str, Any] = {k: getattr(request, k) for k in PASSED
                            if getattr(request, k) is not None}
    out = ChatBody(request, chat)
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": _text(request.instructions)})
        out.sources.append("instructions")
    _messages(request, messages, out.sources)
    chat["messages"] = messages
    if request.max_output_tokens is not None:
        chat["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(request.tools)]
    if request.tool_choice is not None:
        chat["tool_choice"] = _choice(request.tool_choice)
    fmt = request.text.format if request.text is not None else None
    if isinstance(fmt, FormatJsonSchema):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_}}
    elif isinstance(fmt, FormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    if request.logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = request.top_logprobs or None
    return out


def _text(value: Text) -> str:
    """A string, or the text of a list of text parts."""
    return value if isinstance(value, str) else "".join(part.text for part in value)


def _messages(request: ResponsesRequest, out: list[dict[str, Any]],
              sources: list[str]) -> None:
    """``input``'s items as chat messages (a run of calls is one assistant turn)."""
    if isinstance(request.input, str):
        out.append({"role": "user", "content": request.input})
        sources.append("input")
        return
    if not request.input:
        raise APIError(400, "input: must not be empty", param="input")
    for i, item in enumerate(request.input):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
                continue
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
        else:
            continue  # reasoning: none here to replay
        sources.append(f"input.{i}")


def _tool(i: int, tool: ToolIn) -> dict[str, Any]:
    if tool.type != "function":
        raise APIError(400, f"tools.{i}.type: only function tools are supported, got "
                       f"{tool.type!r}", param=f"tools.{i}.type")
    if tool.name is None:
        raise APIError(400, f"tools.{i}.name: required", param=f"tools.{i}.name")
    function = {k: getattr(tool, k) for k in ("name", "description", "parameters", "strict")
                if getattr(tool, k) is not None}
    return {"type": "function", "function": function}


def _choice(choice: Any) -> Any:
    """``tool_choice`` in the chat body's shape."""
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedToolsChoice):
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": [
            {"type": "function", "function": {"name": t.name}} for t in choice.tools]}}
    return choice


def response_body(chat: dict[str, Any], body: dict[str, Any], resp_id: str,
                  created: float | None = None) -> dict[str, Any]:
    """A Response object from a chat completion body (its first choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(message_item(new_id("msg"), message["content"], logprobs=logprobs))
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        output.append(call_item(call["id"], call["function"]["name"], arguments,
                                call_status(arguments)))
    usage = chat.get("usage") or {}
    return envelope(body, resp_id, output, created, choice.get("finish_reason"),
                    usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)] if status == "completed" else []}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` part; ``logprobs`` (``include``'s) as the chat route's
    ``logprobs.content``: token, logprob, bytes, top_logprobs."""
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}


def call_status(arguments: str) -> str:
    """A call's item status: ``incomplete`` when it was cut (its arguments not whole)."""
    return "completed" if whole_arguments(arguments) else "incomplete"


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
