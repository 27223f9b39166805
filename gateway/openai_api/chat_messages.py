"""A chat message as OpenAI's API sends it (text parts, tool calls, a tool's answer) and
the protocol's ``ChatMessage`` it becomes.

Shared by the chat completions body and ``/tokenize``: both take the same messages and must
refuse the same ones (a role OpenAI does not know, a non-text content part) with the same
400.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from gateway.errors import APIError
from gateway.openai_api.tools import ToolCallIn
from protocol.models import ChatMessage

ChatRole = Literal["system", "user", "assistant", "tool", "developer", "function"]  # OpenAI's


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: ChatRole  # anything else: a 400 naming messages.<i>.role
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def to_protocol(self, index: int) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages.{index}.content: only text parts are "
                                   f"supported, got {part.type!r}", param="messages")
            content = "\n".join(part.text or "" for part in content)
        calls = [c.to_protocol() for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(role=self.role, content=content or "", tool_calls=calls,
                           tool_call_id=self.tool_call_id, name=self.name)
