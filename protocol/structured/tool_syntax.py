"""Tool-call syntax per chat-template family: the grammar that enforces calls, and the
parser that reads them back.

The worker compiles ``tool_grammar`` (llguidance's Lark dialect, each function's call an
embedded ``%json`` schema) so the model can only write calls that parse, name an offered
function and carry arguments valid against its schema. The gateway reads them with
``parse_calls`` / ``complete_calls``, which accept every family: the grammar already
decided which one the text is in, so no per-model regex has to guess. Torch-free.

A family is taken from the model's chat template (``detect_syntax``); a template that
knows no tools (the default model's) gets ``hermes``, rendered by the worker's own
fallback (``worker/engine/inputs/tool_prompts.py``). docs/tools.md shows each syntax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol.structured.json_schema import prepare
from protocol.structured.tools import FunctionTool, Syntax, ToolCalls

DEFAULT_SYNTAX: Syntax = "hermes"
_COMPACT = {"whitespace_flexible": False}  # as protocol.structured.constraint.JSON_OPTIONS


@dataclass(frozen=True)
class Family:
    """How one family writes a list of calls: ``open`` + call (``sep`` call)* + ``close``,
    each call a JSON object with the function's name under "name" and its arguments under
    ``args_key``; ``call_open``/``call_close`` wrap each call."""

    open: str
    sep: str
    close: str
    call_open: str
    call_close: str
    args_key: str
    text_lexeme: str  # free text that cannot be (the start of) a call

    @property
    def opener(self) -> str:
        """The text every list of calls starts with."""
        return self.open + self.call_open


FAMILIES: dict[str, Family] = {
    "hermes": Family("", "\n", "", "<tool_call>\n", "\n</tool_call>", "arguments",
                     r"/(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"),
    "llama3_json": Family("", "; ", "", "", "", "parameters", r"/[^{](?s:.*)/"),
    "mistral": Family("[TOOL_CALLS][", ", ", "]", "", "", "arguments",
                      r"/(?s:.+)/ & ~/(?s:\[TOOL_CALLS\].*)/"),
}


def detect_syntax(template: Any) -> Syntax:
    """The family a chat template's text belongs to (``DEFAULT_SYNTAX`` if none)."""
    text = template if isinstance(template, str) else json.dumps(template or "")
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("ipython" in text and '"parameters"' in text):
        return "llama3_json"
    return DEFAULT_SYNTAX


def call_schema(tool: FunctionTool, args_key: str) -> dict[str, Any]:
    """The JSON schema of one call to ``tool``: its name, then its arguments. The
    arguments' ``$defs``/``definitions`` move to the root, where their ``$ref``s
    (``#/$defs/...``) point once the schema is nested."""
    args = prepare(dict(tool.args_schema()))
    hoisted: dict[str, Any] = {k: args.pop(k) for k in ("$defs", "definitions") if k in args}
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: args},
            "required": ["name", args_key], "additionalProperties": False,
            "x-guidance": _COMPACT, **hoisted}


def tool_grammar(spec: ToolCalls, syntax: Syntax) -> str:
    """The Lark grammar (llguidance's) admitting what ``spec`` allows in ``syntax``."""
    fam = FAMILIES[spec.syntax or syntax]
    offered = spec.offered()
    lines = ["%llguidance {}"]
    more = spec.max_calls - 1 if spec.parallel else 0
    calls = "call" if more == 0 else f"call ({json.dumps(fam.sep)} call){{0,{more}}}"
    alternatives = " | ".join(f"fn{i}" for i in range(len(offered)))
    if spec.mode == "auto":
        other = "final" if spec.final_schema is not None else "TEXT"
        lines.append(f"start: calls | {other}")
    else:
        lines.append("start: calls")
    lines.append(f"calls: {_lit(fam.open)} {calls} {_lit(fam.close)}".replace("  ", " "))
    lines.append(f"call: {_lit(fam.call_open)} ({alternatives}) {_lit(fam.call_close)}")
    for i, tool in enumerate(offered):
        lines.append(f"fn{i}: %json {json.dumps(call_schema(tool, fam.args_key))}")
    if spec.mode == "auto" and spec.final_schema is not None:
        final = {**prepare(dict(spec.final_schema))}
        final.setdefault("x-guidance", _COMPACT)
        lines.append(f"final: %json {json.dumps(final)}")
    elif spec.mode == "auto":
        lines.append(f"TEXT: {fam.text_lexeme}")
    return "\n".join(lines) + "\n"


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


# -- reading calls back ------------------------------------------------------------------

Call = tuple[str, str]
"""(function name, arguments as compact JSON text)."""


def parse_calls(text: str, names: set[str],
                cut: bool = False) -> tuple[str | None, list[Call]] | None:
    """(text before the calls or None, the calls) if ``text`` is a complete list of calls
    in any family, to functions in ``names``; None if it is plain text (or malformed).
    ``cut``: the output was cut short (``max_tokens``, a stop string): the calls it
    completed, then the one it was writing, as written so far (``_cut_call``)."""
    for fam in FAMILIES.values():
        at = _start(text, fam, cut)
        if at is None:
            continue
        calls, end = _decode(text, at, fam, names)
        if cut:
            head = fam.sep + fam.call_open if calls else fam.opener
            last = _cut_call(text[end:], head, len(fam.sep) if calls else 0, fam.args_key,
                             names)
            calls += [last] if last is not None else []
        # cut, a family with an opener has begun its calls: what follows is no text
        if (calls or (cut and fam.opener)) and (cut or text[end:].strip() == fam.close):
            return (text[:at].strip() or None), calls
    return None


def whole_arguments(arguments: str) -> bool:
    """Whether a call's ``arguments`` are a whole JSON object (not cut short)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def complete_calls(text: str, names: set[str]) -> list[Call] | None:
    """The calls already complete in a prefix of a streamed output (None: the text is
    not, or not yet known to be, a list of calls)."""
    for fam in FAMILIES.values():
        at = _start(text, fam)
        if at is not None:
            return _decode(text, at, fam, names)[0]
    return None


def might_be_calls(text: str) -> bool:
    """Whether a streamed output's beginning may still become a list of calls."""
    return any(fam.opener.startswith(text) or text.startswith(fam.opener)
               for fam in FAMILIES.values() if fam.opener) or text.startswith("{") \
        or text == ""


def _start(text: str, fam: Family, cut: bool = False) -> int | None:
    """Where ``fam``'s list of calls starts in ``text`` (hermes may follow some text);
    ``cut``: also a text that is only the beginning of the opener (``<tool_c``)."""
    if fam.opener == "":  # llama3_json: the whole output is the JSON
        return 0 if text.startswith("{") else None
    if fam.open == "":
        at = text.find(fam.call_open)
        if at >= 0:
            return at
    elif text.startswith(fam.opener):
        return 0
    return 0 if cut and text and fam.opener.startswith(text) else None


def _decode(text: str, at: int, fam: Family, names: set[str]) -> tuple[list[Call], int]:
    """Every complete call from ``at`` on, and where the last one ended."""
    decoder = json.JSONDecoder()
    calls: list[Call] = []
    pos = at + len(fam.open)
    end = at
    while True:
        head = fam.call_open if not calls else fam.sep + fam.call_open
        if not text.startswith(head, pos):
            break
        try:
            obj, stop = decoder.raw_decode(text, pos + len(head))
        except ValueError:
            break
        if not text.startswith(fam.call_close, stop):
            break
        call = _call(obj, fam.args_key, names)
        if call is None:
            break
        calls.append(call)
        pos = end = stop + len(fam.call_close)
    return calls, end


def _call(obj: Any, args_key: str, names: set[str]) -> Call | None:
    if not isinstance(obj, dict) or set(obj) != {"name", args_key}:
        return None
    name, args = obj["name"], obj[args_key]
    if name not in names or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _cut_call(rest: str, head: str, sep: int, args_key: str, names: set[str]) -> Call | None:
    """The call ``rest`` (what follows the complete calls of a cut output) began, as
    written so far: its name (completed when only one of ``names`` begins with what was
    written) and its arguments' JSON text (compact if it was whole). None when ``rest``
    begins no call: nothing past the separator (``sep`` characters of ``head``), or not
    the family's next call."""
    if len(rest) <= sep or not (rest.startswith(head) or head.startswith(rest)):
        return None
    body = rest[len(head):]
    pos = 0
    for lit in ("{", '"name"', ":", '"'):
        pos, state = _expect(body, pos, lit)
        if state != "ok":
            name = _name_from("", names) if state == "end" else None
            return None if name is None else (name, "")
    close = body.find('"', pos)
    if close < 0:
        name = _name_from(body[pos:], names)
        return None if name is None else (name, "")
    name, pos = body[pos:close], close + 1
    if name not in names:
        return None
    for lit in (",", json.dumps(args_key), ":"):
        pos, state = _expect(body, pos, lit)
        if state != "ok":
            return (name, "") if state == "end" else None
    args = body[pos:].lstrip()
    try:
        obj, _ = json.JSONDecoder().raw_decode(args)
    except ValueError:
        return name, args
    if not isinstance(obj, dict):
        return name, args
    return name, json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _expect(text: str, pos: int, literal: str) -> tuple[int, str]:
    """After optional whitespace at ``pos``: ``literal`` ("ok", the position after it),
    the text ending inside it ("end") or something else ("no")."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    got = text[pos:pos + len(literal)]
    if got == literal:
        return pos + len(literal), "ok"
    if literal.startswith(got) and pos + len(got) == len(text):
        return len(text), "end"
    return pos, "no"


def _name_from(prefix: str, names: set[str]) -> str | None:
    """The function a name cut after ``prefix`` is: the one name beginning with it, else
    the prefix itself (several do); None when none does (not a call)."""
    matches = [n for n in names if n.startswith(prefix)]
    if not matches:
        return None
    return matches[0] if len(matches) == 1 else prefix
