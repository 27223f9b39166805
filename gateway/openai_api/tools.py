"""OpenAI's tool fields (``tools``, ``tool_choice``, ``parallel_tool_calls``) and history
turns (assistant ``tool_calls``, ``tool`` messages) -> the protocol's ``ToolCalls``.

``tool_choice`` ``none`` (or no tools) asks for no calls: the tools are neither rendered
nor enforced. ``auto``, ``required`` and a named function become a ``tools`` constraint
the worker enforces with its grammar engine; a ``response_format`` JSON schema beside
them shapes the answer that is not a call. Each function's schema is checked here with
the same engine, so a construct it cannot enforce is a 400 naming
``tools.<i>.function.parameters`` before anything is enqueued. docs/tools.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import APIError
from gateway.openai_api.structured import _model, check
from protocol.codec import describe_validation_error
from protocol.structured import StructuredOutput
from protocol.tools import NAME_PATTERN, FunctionTool, ToolCall, ToolCalls, ToolMode

_STRICT = ConfigDict(extra="ignore", strict=True)


class FunctionIn(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(BaseModel):
    model_config = _STRICT
    type: str = "function"
    function: FunctionIn


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: NamedFunction


class CallFunctionIn(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    """One call in an assistant message of the history."""

    model_config = _STRICT
    id: str
    type: str = "function"
    function: CallFunctionIn

    def to_protocol(self) -> ToolCall:
        return ToolCall(id=self.id, name=self.function.name,
                        arguments=self.function.arguments)


class ToolFields(BaseModel):
    """The tool fields of /v1/chat/completions."""

    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_names(self) -> tuple[str, ...]:
        """The functions a response may call (empty: tools are off)."""
        if not self.tools or self.tool_choice == "none":
            return ()
        return tuple(t.function.name for t in self.tools)

    def with_tools(self, final: StructuredOutput | None) -> StructuredOutput | None:
        """The request's constraint given its ``response_format`` one (``final``)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice: requires tools", param="tool_choice")
            return final
        if choice == "none":
            return final
        functions = [self._function(i, t) for i, t in enumerate(self.tools)]
        mode: ToolMode = "named" if isinstance(choice, NamedChoice) else choice or "auto"
        name = choice.function.name if isinstance(choice, NamedChoice) else None
        if final is not None and final.kind not in ("json_schema", "json_object"):
            raise APIError(400, f"{final.kind}: cannot be combined with tools (only a "
                           "response_format JSON schema can)", param="tools")
        schema = None if final is None else final.json_schema or {"type": "object"}
        try:
            spec = ToolCalls(tools=functions, mode=mode, name=name,
                             parallel=self.parallel_tool_calls is not False,
                             final_schema=schema if mode == "auto" else None)
        except ValidationError as exc:
            detail = describe_validation_error(exc).split(": ", 1)[-1]
            param = "tool_choice" if name is not None else "tools"
            raise APIError(400, f"{param}: {detail}", param=param) from None
        constraint = StructuredOutput(tools=spec)
        check(constraint, "tools")
        return constraint

    @staticmethod
    def _function(i: int, tool: ToolIn) -> FunctionTool:
        if tool.type != "function":
            raise APIError(400, f"tools.{i}.type: only 'function' tools are supported, got "
                           f"{tool.type!r}", param=f"tools.{i}.type")
        fn = tool.function
        param = f"tools.{i}.function.parameters"
        if fn.parameters is not None:
            if fn.parameters.get("type", "object") != "object":
                raise APIError(400, f"{param}: must be a JSON Schema of type 'object'",
                               param=param)
            check(_model("json_schema", fn.parameters, param), param)
        return FunctionTool(name=fn.name, description=fn.description,
                            parameters=fn.parameters, strict=fn.strict)
