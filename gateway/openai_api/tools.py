"""OpenAI's tool fields (``tools``, ``tool_choice``, ``parallel_tool_calls``) and history
turns (assistant ``tool_calls``, ``tool`` messages) -> the protocol's ``ToolCalls``.

``tool_choice`` ``none`` (or no tools) asks for no calls: the tools are neither rendered
nor enforced. ``auto``, ``required``, a named function and OpenAI's ``allowed_tools``
(``auto`` or ``required`` over a subset of the tools, all of them still rendered) become
a ``tools`` constraint the worker enforces with its grammar engine; a
``response_format`` JSON schema beside them shapes the answer that is not a call. Each
function's schema is checked here with the same engine, so a construct it cannot enforce
is a 400 naming ``tools.<i>.function.parameters`` before anything is enqueued.
docs/tools.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from gateway.errors import APIError
from gateway.openai_api.structured import _model, check
from protocol.codec import describe_validation_error
from protocol.structured.constraint import StructuredOutput
from protocol.structured.tools import NAME_PATTERN, FunctionTool, ToolCall, ToolCalls, ToolMode

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


class AllowedTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTools(BaseModel):
    model_config = _STRICT
    mode: Literal["auto", "required"]
    tools: list[AllowedTool] = Field(min_length=1)


class AllowedToolsChoice(BaseModel):
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``."""

    model_config = _STRICT
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _choice_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type", "function"))
    return getattr(value, "type", None)


ObjectChoice = Annotated[Annotated[NamedChoice, Tag("function")]
                         | Annotated[AllowedToolsChoice, Tag("allowed_tools")],
                         Discriminator(_choice_type)]


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
    tool_choice: Literal["none", "auto", "required"] | ObjectChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_names(self) -> tuple[str, ...]:
        """The functions a response may call (empty: tools are off)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return ()
        if isinstance(choice, NamedChoice):
            return (choice.function.name,)
        if isinstance(choice, AllowedToolsChoice):
            return tuple(dict.fromkeys(t.function.name for t in choice.allowed_tools.tools))
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
        mode: ToolMode = "named" if isinstance(choice, NamedChoice) else \
            choice.allowed_tools.mode if isinstance(choice, AllowedToolsChoice) \
            else choice or "auto"
        name = choice.function.name if isinstance(choice, NamedChoice) else None
        allowed = self._allowed(choice, {f.name for f in functions})
        if final is not None and final.kind not in ("json_schema", "json_object"):
            raise APIError(400, f"{final.kind}: cannot be combined with tools (only a "
                           "response_format JSON schema can)", param="tools")
        schema = None if final is None else final.json_schema or {"type": "object"}
        try:
            spec = ToolCalls(tools=functions, mode=mode, name=name, allowed=allowed,
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
    def _allowed(choice: Any, names: set[str]) -> list[str] | None:
        """``allowed_tools``' function names, each one of the tools (else a 400 naming it)."""
        if not isinstance(choice, AllowedToolsChoice):
            return None
        allowed = []
        for i, tool in enumerate(choice.allowed_tools.tools):
            name = tool.function.name
            if name not in names:
                param = f"tool_choice.allowed_tools.tools.{i}.function.name"
                raise APIError(400, f"{param}: {name!r} is not one of the tools", param=param)
            allowed.append(name)
        return list(dict.fromkeys(allowed))

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
