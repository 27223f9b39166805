"""Pydantic's validation errors -> the request field they are about, as ``param`` names it.

Pydantic puts a union's branch into an error's location (``stop.str``,
``tool_choice.literal['none','auto','required']``, ``messages.0.content.list[TextPart].0``),
which is no field a client can find in its body. ``field_error`` walks each location
along the body model's types and leaves the branches out: a value that fits no branch is
reported at the union's field with what the field takes (``stop: expected a string or a
list of strings``); a value that has one branch's shape (a list for ``str | list[str]``)
is reported where it goes wrong inside that branch (``stop.0``). docs/protocol.md §8
names fields this way: dotted, list items by index.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from protocol.codec import describe_errors

Loc = tuple[Any, ...]
_UNKNOWN = object()  # a place whose type the walk cannot follow: locations stay as given


@dataclass(frozen=True)
class _Site:
    """A union on an error's path: where it is (clean and as pydantic wrote it) and its
    type; ``branch``: the branch the error went into (None: it stopped at the union)."""

    at: Loc
    raw: Loc
    union: Any
    branch: Any


@dataclass(frozen=True)
class _Walked:
    error: Mapping[str, Any]
    clean: Loc
    sites: tuple[_Site, ...]


def field_error(errors: Sequence[Mapping[str, Any]], model: Any = None,
                skip_loc: int = 0) -> tuple[str, str | None]:
    """(message, param) of a 400 for pydantic's ``errors()`` of validating ``model``
    (None: the locations are taken as they are); ``skip_loc`` drops leading location
    parts (FastAPI's ``body``).

    Union by union along the first error's path: where the errors of one union went into
    one branch only, the value has that branch's shape and the search goes on inside it;
    where they did not, the union's field is the answer, with what it takes."""
    group = [_walk(e, model, tuple(e.get("loc", ()))[skip_loc:]) for e in errors]
    if not group:
        return "invalid request", None
    level = 0
    while level < len(group[0].sites):
        site = group[0].sites[level]
        same = [w for w in group if len(w.sites) > level and w.sites[level].raw == site.raw]
        deeper = [w for w in same if w.sites[level].branch is not None
                  and len(w.clean) > len(site.at)]
        if len({w.sites[level].branch for w in deeper}) != 1:
            param = ".".join(str(p) for p in site.at)
            return f"{param}: expected {describe(site.union)}", param or None
        group, level = deeper, level + 1
    shown = [{**w.error, "loc": w.clean} for w in group]
    return describe_errors(shown), _param(shown[0])


def _param(error: Mapping[str, Any]) -> str | None:
    """The dotted location, else the field a model validator's message starts with
    (``"logit_bias: ..."``)."""
    loc = ".".join(str(p) for p in error.get("loc", ()))
    named = str(error.get("msg", "")).removeprefix("Value error, ").split(":", 1)[0]
    return loc or (named if named and " " not in named else None)


def _walk(error: Mapping[str, Any], model: Any, loc: Loc) -> _Walked:
    """``loc`` without union branches, and the unions on the way."""
    clean: list[Any] = []
    sites: list[_Site] = []
    kind: Any = model if model is not None else _UNKNOWN
    for i, part in enumerate(loc):
        kind = _strip(kind)
        members = _members(kind)
        if members is not None and isinstance(part, str):
            sites.append(_Site(tuple(clean), loc[:i], kind, part))
            kind = next((m for m in members if _is_branch(m, part)), _UNKNOWN)
            continue
        clean.append(part)
        kind = _child(kind, part)
    kind = _strip(kind)
    if _members(kind) is not None:  # it stopped at the union (a discriminated one's)
        sites.append(_Site(tuple(clean), loc, kind, None))
    return _Walked(error, tuple(clean), tuple(sites))


def _strip(kind: Any) -> Any:
    """Without ``Annotated`` and without ``None`` where one type is left."""
    while True:
        if typing.get_origin(kind) is typing.Annotated:
            kind = typing.get_args(kind)[0]
            continue
        members = _union_args(kind)
        if members is not None and len(members) == 1:
            kind = members[0]
            continue
        return kind


def _union_args(kind: Any) -> list[Any] | None:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(kind) if a is not type(None)]
    return None


def _members(kind: Any) -> list[Any] | None:
    """A union's types (without None), or None if ``kind`` is not a union."""
    members = _union_args(kind)
    return members if members is not None and len(members) > 1 else None


def _is_model(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _is_branch(member: Any, tag: str) -> bool:
    """Whether pydantic names ``member`` ``tag`` in a location: its class name or its
    discriminator's value (a model), ``literal[...]``, ``list[...]``, ``str`` or
    ``constrained-str``, ..."""
    member = _strip(member)
    if _members(member) is not None:  # a union inside the union (a discriminated one)
        return tag.startswith(("union[", "tagged-union["))
    if _is_model(member):
        return tag == member.__name__ or any(
            tag in typing.get_args(f.annotation) for f in member.model_fields.values()
            if typing.get_origin(f.annotation) is typing.Literal)
    origin = typing.get_origin(member)
    if origin is typing.Literal:
        return tag.startswith("literal[")
    base = origin or member
    name = base.__name__.lower() if isinstance(base, type) else ""
    return bool(name) and (tag in (name, f"constrained-{name}") or tag.startswith(name + "["))


def _child(kind: Any, part: Any) -> Any:
    """The type at ``part`` inside ``kind``."""
    if kind is _UNKNOWN:
        return _UNKNOWN
    if _is_model(kind):
        fields = kind.model_fields
        field = fields.get(part) or next(
            (f for f in fields.values() if f.alias == part), None)
        return field.annotation if field is not None else _UNKNOWN
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (list, tuple, set, frozenset, Sequence) and isinstance(part, int) and args:
        return args[0]
    if origin in (dict, Mapping) and len(args) == 2:
        return args[0] if part == "[key]" else args[1]
    return _UNKNOWN


def _words(kind: Any, plural: bool) -> list[str]:
    """A union member's description; a union inside the union (a discriminated one)
    gives one per member."""
    members = _members(_strip(kind))
    return [describe(m, plural) for m in members] if members else [describe(kind, plural)]


def describe(kind: Any, plural: bool = False) -> str:
    """What a type takes, in words: ``a string or a list of strings``."""
    kind = _strip(kind)
    members = _members(kind)
    if members is not None:
        words = list(dict.fromkeys(w for m in members for w in _words(m, plural)))
        comma = "," if any(" or " in w for w in words) else ""
        return words[0] if len(words) == 1 else \
            ", ".join(words[:-1]) + f"{comma} or " + words[-1]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        values = [json.dumps(a) for a in args]
        return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]
    if origin in (list, tuple, set, frozenset, Sequence):
        inner = describe(args[0], plural=True) if args else "values"
        return ("lists of " if plural else "a list of ") + inner
    if _is_model(kind) and "type" in kind.model_fields:  # a discriminated union's member
        tag = kind.model_fields["type"].annotation
        if typing.get_origin(tag) is typing.Literal:
            return ("objects" if plural else "an object") + f" of type {describe(tag)}"
    if origin in (dict, Mapping) or _is_model(kind):
        return "objects" if plural else "an object"
    names = {str: ("a string", "strings"), int: ("an integer", "integers"),
             float: ("a number", "numbers"), bool: ("a boolean", "booleans")}
    one, many = names.get(kind, ("a valid value", "valid values"))
    return many if plural else one
