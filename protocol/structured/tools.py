"""Tool calls on the wire: the functions a request offers and how the model may call them.

``ToolCalls`` is ``StructuredOutput.tools``: a constraint like any other, enforced by the
grammar engine (``protocol/structured/tool_syntax.py`` writes its grammar), so a call the model
emits
always parses and its arguments validate against the function's schema. The same list
reaches the chat template (``apply_chat_template(tools=...)``) through the worker's
prompt builder. ``ToolCall`` is one call in the history (an assistant message's
``tool_calls``); a ``tool`` message answers one by ``tool_call_id``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128
MAX_CALLS = 8
"""Calls one turn may make when parallel calls are allowed, unless ``max_calls`` says
otherwise: a model that never learned to stop after a call (the default model) would
otherwise repeat calls until ``max_tokens`` and end in a call cut in half."""
ToolMode = Literal["auto", "required", "named"]
Syntax = Literal["hermes", "llama3_json", "mistral"]
"""How a model writes a call (its chat template's family; docs/tools.md):
``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call
(Hermes, Qwen 2/2.5/3, and Ferry's default for templates that know no tools);
``llama3_json``: ``{"name": ..., "parameters": {...}}``, several joined by ``; ``;
``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""


class FunctionTool(BaseModel):
    """One function the model may call (OpenAI's ``tools[i].function``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=16 * 1024)
    parameters: dict[str, Any] | None = Field(default=None, description=(
        "JSON Schema of the arguments (an object); absent: any object."))
    strict: bool | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as ``apply_chat_template(tools=...)`` takes it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name,
                                    "parameters": self.args_schema()}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def args_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class ToolCalls(BaseModel):
    """Which calls the output may hold; see docs/protocol.md §1.2 and docs/tools.md.

    ``mode`` ``auto``: free text (or, with ``final_schema``, a JSON answer following it)
    or calls; ``required``: one or more calls to any tool; ``named``: calls to ``name``
    only. ``allowed`` (OpenAI's ``allowed_tools``): with ``auto`` or ``required``, calls
    may name only these tools (every tool is still shown to the model). ``parallel``
    false: at most one call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tools: list[FunctionTool] = Field(min_length=1, max_length=MAX_TOOLS)
    mode: ToolMode = "auto"
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    allowed: list[str] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS,
                                      description="The tools a call may name (None: all).")
    parallel: bool = True
    max_calls: int = Field(default=MAX_CALLS, ge=1, le=MAX_TOOLS, description=(
        "With parallel: the most calls one output may hold."))
    final_schema: dict[str, Any] | None = Field(default=None, description=(
        "mode auto: a non-tool answer must be JSON following this schema."))
    syntax: Syntax | None = Field(default=None, description=(
        "Force a call syntax; None: the worker takes its chat template's."))

    @model_validator(mode="after")
    def _consistent(self) -> ToolCalls:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("tools.name: required with mode 'named', and only with it")
        if self.name is not None and self.name not in names:
            raise ValueError(f"tools.name: {self.name!r} is not one of the tools")
        if self.final_schema is not None and self.mode != "auto":
            raise ValueError("tools.final_schema: only with mode 'auto'")
        if self.allowed is not None:
            unknown = [a for a in self.allowed if a not in names]
            if unknown:
                raise ValueError(f"tools.allowed: {unknown[0]!r} is not one of the tools")
            if self.mode == "named":
                raise ValueError("tools.allowed: not with mode 'named'")
        return self

    def offered(self) -> list[FunctionTool]:
        """The tools a call may name."""
        if self.name is None and self.allowed is None:
            return list(self.tools)
        allowed = {self.name} if self.name is not None else set(self.allowed or ())
        return [t for t in self.tools if t.name in allowed]


class ToolCall(BaseModel):
    """One call in the history: an assistant message's ``tool_calls[i]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(default="{}", description="The arguments as JSON text.")

    def template_dict(self) -> dict[str, Any]:
        """As chat templates read it: arguments as an object where they parse to one
        (Qwen's and Llama's templates ``tojson`` them), else as the text."""
        try:
            args: Any = json.loads(self.arguments)
        except ValueError:
            args = self.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": args}}
