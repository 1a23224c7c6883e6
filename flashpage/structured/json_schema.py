"""JSON Schema -> a regex matching JSON texts valid against it (the common subset).

Supported: ``type`` (one or a list) string / integer / number / boolean / null / array /
object, ``enum``, ``const``, ``anyOf`` / ``oneOf`` (alternatives; oneOf's exclusivity is not
enforced), ``allOf`` of one schema, ``$ref`` into the same document (``#/$defs/...``,
``#/definitions/...``, any local JSON pointer; a recursive reference is a ValueError).
Strings: ``minLength`` / ``maxLength`` (in JSON characters: an escape is one), ``pattern``
(matched against the raw text between the quotes, anchored, as outlines does), ``format``
date / time / date-time / uuid (RFC 3339's shapes, the offset optional for a time; other
formats are annotations: any string). Integers:
``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (a digit-range regex).
Arrays: ``items``, ``minItems`` / ``maxItems``. Objects: ``properties`` in schema order,
``required``; an optional property may be left out, no other property is generated; an
object without ``properties`` takes any keys with ``additionalProperties``' values (any
JSON value by default).

Whitespace: ``[ ]?`` (at most one space) where JSON allows it, after ``{ [ , :`` and before
``} ]``: ``json.dumps``' default separators and compact output both match, and a small
model cannot wander off into runs of newlines. ``whitespace`` overrides it ("" for none).

Any JSON value (``{}``, ``true``, a missing ``items``, ``{"type": "json_object"}``) is a
regex too, so its nesting is bounded: ``ANY_DEPTH`` levels of objects / arrays.
Constraining keywords that are not supported (``not``, ``if``, ``patternProperties``,
``uniqueItems``, number bounds, ...) are a ValueError naming them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flashpage.structured.int_range import int_range_regex

WHITESPACE = r"[ ]?"
ANY_DEPTH = 3  # nesting levels of objects / arrays inside a value of unknown shape
JSON_OBJECT_DEPTH = 4  # {"type": "json_object"}: an object and 3 levels inside it

STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = r"(?:true|false)"
NULL = "null"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?"
_OFFSET = r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {  # RFC 3339's shapes; the calendar (February 30th) is not checked
    "date": f'"{_DATE}"',
    "time": f'"{_TIME}{_OFFSET}?"',
    "date-time": f'"{_DATE}T{_TIME}{_OFFSET}"',
    "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
}
# Keywords that constrain instances in ways this regex cannot (or does not yet) express.
UNSUPPORTED = ("not", "if", "then", "else", "patternProperties", "propertyNames",
               "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
               "unevaluatedItems", "contains", "minContains", "maxContains", "prefixItems",
               "additionalItems", "minProperties", "maxProperties", "multipleOf")
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")


def json_schema_to_regex(schema: dict[str, Any] | bool | str, whitespace: str = WHITESPACE) -> str:
    """A regex for the JSON texts valid against ``schema`` (a dict, a bool, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    return _Compiler(schema, whitespace).regex(schema, "#")


def json_object_regex(whitespace: str = WHITESPACE) -> str:
    """Any JSON object, nested at most ``JSON_OBJECT_DEPTH`` levels deep."""
    c = _Compiler({}, whitespace)
    return c.object_of(c.any_value(JSON_OBJECT_DEPTH - 1))


def literal(value: Any) -> str:
    """A regex matching exactly ``json.dumps(value)``."""
    return re.escape(json.dumps(value))


class _Compiler:
    def __init__(self, root: dict[str, Any] | bool, ws: str) -> None:
        self.root = root
        self.ws = ws
        self._refs: list[str] = []  # the $refs being expanded (to refuse recursion)

    def regex(self, s: Any, where: str) -> str:
        if s is True or s == {}:
            return self.any_value(ANY_DEPTH)
        if s is False:
            raise ValueError(f"{where}: the schema false matches nothing")
        if not isinstance(s, dict):
            raise ValueError(f"{where}: a schema must be an object or a boolean, got {s!r}")
        bad = [k for k in UNSUPPORTED if k in s]
        if bad:
            raise ValueError(f"{where}: JSON schema keyword {bad[0]!r} is not supported")
        if s.get("uniqueItems"):
            raise ValueError(f"{where}: JSON schema keyword 'uniqueItems' is not supported")
        if "$ref" in s:
            return self.ref(s["$ref"], where)
        if "const" in s:
            return literal(s["const"])
        if "enum" in s:
            values = s["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"{where}: enum must be a non-empty list")
            return _alt([literal(v) for v in values])
        for key in ("anyOf", "oneOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise ValueError(f"{where}: {key} must be a non-empty list of schemas")
                return _alt([self.regex(sub, f"{where}/{key}/{i}") for i, sub in enumerate(subs)])
        if "allOf" in s:
            subs = s["allOf"]
            if not isinstance(subs, list) or len(subs) != 1:
                raise ValueError(f"{where}: allOf is supported with exactly one schema")
            return self.regex(subs[0], f"{where}/allOf/0")
        t = s.get("type", _infer_type(s))
        if t is None:
            return self.any_value(ANY_DEPTH)
        if isinstance(t, list):
            if not t:
                raise ValueError(f"{where}: type must not be an empty list")
            return _alt([self.typed(s, x, where) for x in t])
        return self.typed(s, t, where)

    def typed(self, s: dict[str, Any], t: Any, where: str) -> str:
        if t not in _TYPES:
            raise ValueError(f"{where}: unknown type {t!r} (one of {', '.join(_TYPES)})")
        if t == "number" and any(k in s for k in _NUMBER_BOUNDS):
            raise ValueError(f"{where}: minimum/maximum on numbers are not supported "
                             "(on integers they are)")
        if t == "string":
            return self.string(s, where)
        if t == "integer":
            return self.integer(s, where)
        if t == "number":
            return NUMBER
        if t == "boolean":
            return BOOLEAN
        if t == "null":
            return NULL
        if t == "array":
            return self.array(s, where)
        return self.object(s, where)

    def string(self, s: dict[str, Any], where: str) -> str:
        if "pattern" in s:
            pattern = s["pattern"]
            if not isinstance(pattern, str):
                raise ValueError(f"{where}: pattern must be a string")
            if pattern.startswith("^"):
                pattern = pattern[1:]
            if pattern.endswith("$") and not pattern.endswith("\\$"):
                pattern = pattern[:-1]
            return f'"(?:{pattern})"'
        fmt = s.get("format")
        if fmt in FORMATS:
            return FORMATS[fmt]
        lo, hi = _bounds(s, "minLength", "maxLength", where)
        if lo == 0 and hi is None:
            return STRING
        return f'"{_repeat(STRING_CHAR, lo, hi)}"'

    def integer(self, s: dict[str, Any], where: str) -> str:
        lo, hi = s.get("minimum"), s.get("maximum")
        for key, bound in (("minimum", lo), ("maximum", hi), ("exclusiveMinimum", s.get("exclusiveMinimum")),
                           ("exclusiveMaximum", s.get("exclusiveMaximum"))):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int | float)):
                raise ValueError(f"{where}: {key} must be a number")
        lo = None if lo is None else _ceil(lo)
        hi = None if hi is None else _floor(hi)
        if (x := s.get("exclusiveMinimum")) is not None:
            lo = max(_floor(x) + 1, lo) if lo is not None else _floor(x) + 1
        if (x := s.get("exclusiveMaximum")) is not None:
            hi = min(_ceil(x) - 1, hi) if hi is not None else _ceil(x) - 1
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"{where}: no integer lies between the bounds")
        return INTEGER if lo is None and hi is None else int_range_regex(lo, hi)

    def array(self, s: dict[str, Any], where: str) -> str:
        item = self.regex(s["items"], f"{where}/items") if "items" in s else self.any_value(ANY_DEPTH - 1)
        lo, hi = _bounds(s, "minItems", "maxItems", where)
        ws = self.ws
        if hi == 0:
            return rf"\[{ws}\]"
        more = _repeat(f"{ws},{ws}{item}", max(lo - 1, 0), None if hi is None else hi - 1)
        body = f"{item}{more}"
        if lo == 0:
            body = f"(?:{body})?"
        return rf"\[{ws}{body}{ws}\]"

    def object(self, s: dict[str, Any], where: str) -> str:
        props = s.get("properties")
        extra = s.get("additionalProperties", True)
        if props is None or (props == {} and extra is not False):
            if extra is False:
                return rf"\{{{self.ws}\}}"
            value = self.any_value(ANY_DEPTH - 1) if extra in (True, {}) else \
                self.regex(extra, f"{where}/additionalProperties")
            return self.object_of(value)
        if not isinstance(props, dict):
            raise ValueError(f"{where}: properties must be an object")
        required = s.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise ValueError(f"{where}: required must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(f"{where}: required property {missing[0]!r} is not in properties")
        ws = self.ws
        if not props:  # properties {} and additionalProperties false
            return rf"\{{{ws}\}}"
        items = [(f"{literal(name)}{ws}:{ws}{self.regex(sub, f'{where}/properties/{name}')}",
                  name in required) for name, sub in props.items()]
        sep = f"{ws},{ws}"
        # One alternative per property that may come first: every one before it is
        # optional and absent; after it, required ones follow with a comma, optional ones
        # may. The first required property ends the list of candidates.
        firsts = []
        for i, (first, req) in enumerate(items):
            rest = "".join(f"{sep}{p}" if r else f"(?:{sep}{p})?" for p, r in items[i + 1:])
            firsts.append(f"{first}{rest}")
            if req:
                break
        body = _alt(firsts)
        if not any(r for _, r in items):
            body = f"(?:{body})?"
        return rf"\{{{ws}{body}{ws}\}}"

    def object_of(self, value: str) -> str:
        ws = self.ws
        member = f"{STRING}{ws}:{ws}{value}"
        return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"

    def any_value(self, depth: int) -> str:
        """Any JSON value with at most ``depth`` levels of objects / arrays."""
        scalars = [STRING, NUMBER, BOOLEAN, NULL]
        if depth <= 0:
            return _alt(scalars)
        inner = self.any_value(depth - 1)
        ws = self.ws
        array = rf"\[{ws}(?:{inner}(?:{ws},{ws}{inner})*)?{ws}\]"
        return _alt([*scalars, self.object_of(inner), array])

    def ref(self, ref: Any, where: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"{where}: only local $refs ('#/...') are supported, got {ref!r}")
        if ref in self._refs:
            raise ValueError(f"{where}: recursive $ref {ref!r} is not supported")
        target: Any = self.root
        for part in (p for p in ref[1:].split("/") if p):
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                raise ValueError(f"{where}: $ref {ref!r} points at nothing")
        self._refs.append(ref)
        try:
            return self.regex(target, ref)
        finally:
            self._refs.pop()


def _infer_type(s: dict[str, Any]) -> str | None:
    if "properties" in s or "additionalProperties" in s:
        return "object"
    if "items" in s or "minItems" in s or "maxItems" in s:
        return "array"
    if any(k in s for k in ("minLength", "maxLength", "pattern", "format")):
        return "string"
    return None


def _bounds(s: dict[str, Any], lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
    lo, hi = s.get(lo_key, 0), s.get(hi_key)
    for key, v in ((lo_key, lo), (hi_key, hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{where}: {key} must be a non-negative integer, got {v!r}")
    if hi is not None and hi < lo:
        raise ValueError(f"{where}: {hi_key} ({hi}) is below {lo_key} ({lo})")
    return lo, hi


def _repeat(x: str, lo: int, hi: int | None) -> str:
    if hi is None:
        return f"(?:{x})*" if lo == 0 else f"(?:{x}){{{lo},}}"
    if lo == hi:
        return "" if lo == 0 else f"(?:{x}){{{lo}}}"
    return f"(?:{x}){{{lo},{hi}}}"


def _alt(options: list[str]) -> str:
    unique = list(dict.fromkeys(options))
    return unique[0] if len(unique) == 1 else "(?:" + "|".join(unique) + ")"


def _floor(x: float) -> int:
    return int(x // 1)


def _ceil(x: float) -> int:
    return -int(-x // 1)
