"""JSON Schema preparation before llguidance: closed objects, number bounds, and schemas no
document meets.

Three things llguidance does not do for us, all found by driving a small model:

* An object schema that lists its ``properties`` and says nothing of others is open in
  JSON Schema, and llguidance lets the model add keys: the default model invented keys
  after the declared ones and never closed the object (15 of 20 seeds). Clients send
  such schemas all the time (LangChain's ``bind_tools`` without ``strict``, LiteLLM's
  ``hosted_vllm/`` provider, which deletes every ``"additionalProperties": false``,
  pydantic's ``model_json_schema()``), counting on vLLM's default grammar backend, which
  closes them. ``close_declared`` does the same: such an object gets
  ``"additionalProperties": false``; one that says ``"additionalProperties": true`` (or a
  schema) stays as written, and so do a bare ``{"type": "object"}`` (any object), a
  member of an ``allOf`` (closing it would refuse its siblings' keys) and an object
  requiring a key it does not list. A top-level ``"x-ferry": {"closed_objects": false}``
  turns this off for the schema.

* An unbounded ``"type": "integer"`` let the model write a 170-digit integer until
  ``max_tokens``, so the JSON never closed. ``bound_numbers`` gives every integer without
  bounds the int64 range and every number without bounds a magnitude of at most 1e15 and
  at most 9 decimals (no exponent), so constrained JSON parses in ordinary languages. A
  schema turns this off with a top-level ``"x-ferry": {"bounded_numbers": false}``.
  (llguidance reads bounds as doubles and cannot take -2**63 itself, so the lowest
  integer is -(2**63 - 1024).)
* A ``$ref`` cycle with no base case (``{"$ref": "#"}``, or a -> b -> a where every path
  requires the next) compiles, but no finite document matches it: the model either may
  emit nothing, or is forced into an endless ``{"a":{"a":...``. ``recursion_error`` finds
  such subschemas by comparing two fixpoints of "some finite instance exists": nodes that
  are satisfiable when cycles are assumed satisfiable (greatest fixpoint) but not when they
  must bottom out (least fixpoint) are exactly the ones only infinite recursion satisfies.
  Other unsatisfiable schemas (``false``, ``minimum > maximum``) are llguidance's to report.

Both are conservative: a keyword not understood here never makes a schema an error.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

OPTIONS_KEY = "x-ferry"
INT_MIN = -(2**63 - 1024)  # the lowest bound llguidance takes (it parses bounds as doubles)
INT_MAX = 2**63 - 1
NUMBER_LIMIT = 1e15
NUMBER_STEP = 1e-9  # at most 9 decimals

_SCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "not", "if",
           "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def prepare(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema llguidance compiles: Ferry's options removed, objects closed and numbers
    bounded unless turned off; ValueError if only an infinite document could match it."""
    error = recursion_error(schema)
    if error is not None:
        raise ValueError(error)
    options = schema.get(OPTIONS_KEY)
    options = options if isinstance(options, dict) else {}
    schema = {k: v for k, v in schema.items() if k != OPTIONS_KEY}
    if options.get("closed_objects") is not False:
        schema = close_declared(schema)
    if options.get("bounded_numbers") is not False:
        schema = bound_numbers(schema)
    return schema


def subschemas(node: dict[str, Any]) -> list[tuple[str, Any]]:
    """(keyword path, subschema) of every schema directly inside ``node``."""
    out: list[tuple[str, Any]] = []
    for key in _SCHEMA:
        if isinstance(node.get(key), dict | bool):
            out.append((key, node[key]))
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += [(f"{key}.{name}", sub) for name, sub in node[key].items()
                    if isinstance(sub, dict | bool)]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += [(f"{key}.{i}", sub) for i, sub in enumerate(node[key])
                    if isinstance(sub, dict | bool)]
    return out


def rewrite(schema: dict[str, Any], visit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A deep copy of ``schema`` with ``visit`` applied to every (sub)schema object."""
    schema = copy.deepcopy(schema)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            visit(node)
            stack += [sub for _, sub in subschemas(node)]
    return schema


def bound_numbers(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where each integer/number schema without bounds gets the default ones."""
    return rewrite(schema, _bound_node)


def _bound_node(node: dict[str, Any]) -> None:
    if "const" in node or "enum" in node:
        return  # the values are given: nothing to bound
    types = _types(node)
    if "integer" in types:
        _bound(node, INT_MIN, INT_MAX)
    elif "number" in types:
        _bound(node, -NUMBER_LIMIT, NUMBER_LIMIT)
        node.setdefault("multipleOf", NUMBER_STEP)


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where each object schema without ``additionalProperties`` gets ``false``
    (vLLM's ``disable_additional_properties``)."""
    def close(node: dict[str, Any]) -> None:
        if ("object" in _types(node) or "properties" in node) \
                and "additionalProperties" not in node:
            node["additionalProperties"] = False

    return rewrite(schema, close)


def close_declared(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where each object schema that lists its ``properties`` and says nothing of
    other keys gets ``"additionalProperties": false`` (vLLM's default backend's rule);
    ``allOf`` members are left open, so that their keys add up."""
    schema = copy.deepcopy(schema)
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict):
            continue
        if not in_all_of and _lists_its_keys(node):
            node["additionalProperties"] = False
        stack += [(sub, key.startswith("allOf.")) for key, sub in subschemas(node)]
    return schema


def _lists_its_keys(node: dict[str, Any]) -> bool:
    """An object schema with ``properties``, silent about other keys, whose required keys
    are all among its properties."""
    props = node.get("properties")
    if not isinstance(props, dict) or any(
            k in node for k in ("additionalProperties", "unevaluatedProperties", "allOf")):
        return False
    required = node.get("required")
    return not isinstance(required, list) or "patternProperties" in node or all(
        name in props for name in required if isinstance(name, str))


def _types(node: dict[str, Any]) -> list[Any]:
    types = node.get("type")
    return [types] if isinstance(types, str) else types if isinstance(types, list) else []


def _bound(node: dict[str, Any], low: float, high: float) -> None:
    """Add the missing side(s), unless the given other side already lies beyond it (the
    schema asks for huge numbers on purpose: leave it as written)."""
    given_low = _number(node.get("minimum", node.get("exclusiveMinimum")))
    given_high = _number(node.get("maximum", node.get("exclusiveMaximum")))
    if "minimum" not in node and "exclusiveMinimum" not in node \
            and (given_high is None or given_high >= low):
        node["minimum"] = low
    if "maximum" not in node and "exclusiveMaximum" not in node \
            and (given_low is None or given_low <= high):
        node["maximum"] = high


def _number(value: Any) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


class _Graph:
    """The schema's nodes (by identity), where each was first reached, and local $refs."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes: dict[int, Any] = {}
        self.paths: dict[int, str] = {}
        stack: list[tuple[Any, str]] = [(root, "")]
        while stack:
            node, path = stack.pop()
            if id(node) in self.nodes:
                continue
            self.nodes[id(node)] = node
            self.paths[id(node)] = path or "(root)"
            if isinstance(node, dict):
                for key, sub in subschemas(node):
                    stack.append((sub, f"{path}.{key}" if path else key))
                target = self.ref(node)
                if target is not None:
                    stack.append((target, path or "(root)"))

    def ref(self, node: dict[str, Any]) -> Any:
        """The node a local ``$ref`` ("#", "#/$defs/a") points to; None if none or not
        local (llguidance reports those)."""
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        target: Any = self.root
        for part in (p for p in ref[1:].split("/") if p):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        return target if isinstance(target, dict | bool) else None


def recursion_error(schema: dict[str, Any]) -> str | None:
    """Why only an infinite document could match (a path into the schema), or None."""
    graph = _Graph(schema)
    if not any(isinstance(n, dict) and "$ref" in n for n in graph.nodes.values()):
        return None
    least = _fixpoint(graph, assume=False)
    greatest = _fixpoint(graph, assume=True)
    looping = [key for key in graph.nodes if greatest[key] and not least[key]]
    if not looping:
        return None
    where = min((graph.paths[key] for key in looping), key=lambda p: (p.count("."), p))
    return (f"unsatisfiable schema: {where} can only be met by an infinitely deep "
            "document (a $ref cycle with no base case)")


def _fixpoint(graph: _Graph, assume: bool) -> dict[int, bool]:
    """Satisfiability of every node, iterated from ``assume`` until nothing changes."""
    sat = {key: assume for key in graph.nodes}
    changed = True
    while changed:
        changed = False
        for key, node in graph.nodes.items():
            value = _satisfiable(graph, node, sat)
            if value != sat[key]:
                sat[key] = value
                changed = True
    return sat


def _satisfiable(graph: _Graph, node: Any, sat: dict[int, bool]) -> bool:
    """One step: can ``node`` have a finite instance, given ``sat`` for its subschemas."""
    if isinstance(node, bool):
        return node

    def ok(sub: Any) -> bool:
        return sat.get(id(sub), True)

    target = graph.ref(node)
    if target is not None and not ok(target):
        return False
    if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(ok(s) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True
    types = _types(node)
    if not types or any(t not in ("object", "array") for t in types):
        return True  # a scalar type is always possible
    return any(_object_ok(node, ok) if t == "object" else _array_ok(node, ok) for t in types)


def _object_ok(node: dict[str, Any], ok: Any) -> bool:
    props: dict[str, Any] = node.get("properties") or {}
    required: list[Any] = node.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        return True
    return all(ok(props[name]) for name in required if isinstance(name, str) and name in props)


def _array_ok(node: dict[str, Any], ok: Any) -> bool:
    low = node.get("minItems", 0)
    if not isinstance(low, int) or low <= 0:
        return True
    prefix: list[Any] = node.get("prefixItems") or []
    if not isinstance(prefix, list):
        prefix = []
    items = node.get("items")
    for i in range(min(low, len(prefix) + 1)):
        sub = prefix[i] if i < len(prefix) else items
        if isinstance(sub, dict | bool) and not ok(sub):
            return False
    return True
