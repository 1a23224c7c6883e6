"""JSON Schema -> regex: ``json.dumps`` of valid instances (default and compact separators)
match, invalid ones do not, and every text drawn from the regex's language parses as JSON
valid against the schema (checked by ``jsonschema``, an independent validator)."""

from __future__ import annotations

import json
import random
import re

import pytest

from flashpage.structured.automaton import ByteNFA, LazyDFA
from flashpage.structured.int_range import int_range_regex
from flashpage.structured.json_schema import (
    JSON_OBJECT_DEPTH,
    json_object_regex,
    json_schema_to_regex,
)
from flashpage.structured.regex_parser import parse_regex
from tests.structured.test_regex import sample

jsonschema = pytest.importorskip("jsonschema")
FORMAT_CHECKER = jsonschema.FormatChecker()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": r"^[a-z]+@[a-z]+\.com$"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 1, "maxItems": 3},
        "kind": {"const": "person"},
        "alive": {"type": "boolean"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": ["string", "null"]}},
                    "required": ["city"]},
    },
    "required": ["name", "age"],
}
DEFS = {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"], "additionalProperties": False}},
    "definitions": {"color": {"enum": ["red", "green"]}},
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/point"}, "path": {"type": "array", "items": {"$ref": "#/$defs/point"}},
                   "color": {"$ref": "#/definitions/color"},
                   "id": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "string", "format": "uuid"}]}},
    "required": ["a", "color"],
}
FORMATS = {
    "type": "object",
    "properties": {"when": {"type": "string", "format": "date-time"}, "day": {"type": "string", "format": "date"},
                   "at": {"type": "string", "format": "time"}, "short": {"type": "string", "maxLength": 3},
                   "n": {"oneOf": [{"type": "integer", "maximum": -5}, {"type": "null"}]}},
    "required": ["when"],
}
OPTIONAL = {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "boolean"},
                                             "r": {"type": "null"}}}
MAP = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}}
ANY_ITEMS = {"type": "array", "maxItems": 4}

CASES = [
    (PERSON,
     [{"name": "Ada", "age": 36}, {"name": "B", "age": 0, "email": "a@b.com", "score": -1.5e3, "tags": ["a", 3],
                                    "kind": "person", "alive": True, "address": {"city": "X", "zip": None}},
      {"name": "ünï\"\\", "age": 130, "tags": [None, None, "b"], "address": {"city": ""}}],
     [{"age": 36}, {"name": "", "age": 3}, {"name": "Ada", "age": -1}, {"name": "Ada", "age": 131},
      {"name": "x" * 11, "age": 1}, {"name": "A", "age": 1, "tags": []}, {"name": "A", "age": 1, "kind": "cat"},
      {"name": "A", "age": 1, "email": "A@b.com"}, {"name": "A", "age": 1.5}, {"name": "A", "age": 1, "address": {}},
      {"name": "A", "age": "1"}, ["Ada", 36], "Ada"]),
    (DEFS,
     [{"a": {"x": 1, "y": -2}, "color": "red"},
      {"a": {"x": 0, "y": 0}, "path": [{"x": 1, "y": 2}, {"x": 3, "y": 4}], "color": "green",
       "id": "123e4567-e89b-12d3-a456-426614174000"}, {"a": {"x": 5, "y": 5}, "color": "red", "id": 7}],
     [{"a": {"x": 1}, "color": "red"}, {"a": {"x": 1, "y": 2}, "color": "blue"}, {"color": "red"},
      {"a": {"x": 1, "y": 2}, "color": "red", "id": 0}, {"a": {"x": 1, "y": 2}, "color": "red", "id": "nope"}]),
    (FORMATS,
     [{"when": "2024-01-31T12:00:00Z"}, {"when": "1999-12-01T23:59:59.5+05:30", "day": "2020-02-29",
                                         "at": "00:00:00", "short": "abc", "n": -5}, {"when": "2024-01-31T12:00:00-01:00", "n": None}],
     [{"when": "2024-13-01T00:00:00Z"}, {"when": "yesterday"}, {"when": "2024-01-31T12:00:00"}, {"when": "2024-01-31T12:00:00Z", "short": "abcd"},
      {"when": "2024-01-31T12:00:00Z", "n": -4}, {"day": "2020-01-01"}]),
    (OPTIONAL, [{}, {"p": 1}, {"q": False}, {"r": None}, {"p": -3, "r": None}, {"p": 0, "q": True, "r": None}],
     [{"q": 1}, {"p": None}, [], None]),
    (MAP, [{}, {"a": 1}, {"b c": 20, "": 3}], [{"a": 0}, {"a": "1"}, [1]]),
    ({"type": "object", "properties": {}, "additionalProperties": False}, [{}], [{"a": 1}, []]),
    (ANY_ITEMS, [[], [1, "x", None, {"a": [True]}], [[[]]]], [[1, 2, 3, 4, 5], {}, "[]"]),
    ({"enum": ["x", 1, None, True, 2.5]}, ["x", 1, None, True, 2.5], ["y", 2, False]),
    ({"type": "string", "pattern": "^[ab]{2}$"}, ["ab", "bb"], ["abc", "a", "", 5]),
    ({}, [1, "s", None, {"a": [1, {"b": None}]}, [True]], []),
]


def _matcher(schema):
    pattern = json_schema_to_regex(schema)
    return pattern, LazyDFA(ByteNFA(parse_regex(pattern)))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_valid_instances_match_and_invalid_do_not(case):
    schema, valid, invalid = CASES[case]
    _, dfa = _matcher(schema)
    for v in valid:
        jsonschema.validate(v, schema, format_checker=FORMAT_CHECKER)  # the test data itself
        for text in (json.dumps(v), json.dumps(v, separators=(",", ":")), json.dumps(v, ensure_ascii=False)):
            assert dfa.matches(text.encode()), text
    for v in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(v, schema, format_checker=FORMAT_CHECKER)
        assert not dfa.matches(json.dumps(v).encode()), v


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_text_of_the_regex_is_valid_json(case):
    schema = CASES[case][0]
    pattern, dfa = _matcher(schema)
    tree, rng = parse_regex(pattern), random.Random(case)
    for _ in range(200):
        text = sample(tree, rng)
        assert dfa.matches(text.encode())
        jsonschema.validate(json.loads(text), schema)  # formats: shapes only (no calendar)


def test_json_object_regex_bounded_depth():
    pattern = json_object_regex()
    dfa = LazyDFA(ByteNFA(parse_regex(pattern)))

    def nested(depth):
        return {"k": nested(depth - 1)} if depth > 1 else {"k": 1}

    for v in [{}, {"a": 1, "b": [1, 2.5e-3, "x", None, True], "c": {"d": {"e": []}}}, nested(JSON_OBJECT_DEPTH)]:
        assert dfa.matches(json.dumps(v).encode()), v
    for v in [nested(JSON_OBJECT_DEPTH + 1), [1], "x", 1, None]:
        assert not dfa.matches(json.dumps(v).encode()), v
    for text in ["{", '{"a":}', '{"a" 1}', "{'a': 1}", '{"a": 01}', '{"a": 1,}']:
        assert not dfa.matches(text.encode()), text
    rng = random.Random(0)
    tree = parse_regex(pattern)
    for _ in range(100):
        assert isinstance(json.loads(sample(tree, rng)), dict)


def test_whitespace_choice():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    tight = LazyDFA(ByteNFA(parse_regex(json_schema_to_regex(schema, whitespace=""))))
    assert tight.matches(b'{"a":[1,2]}') and not tight.matches(b'{"a": [1, 2]}')
    loose = LazyDFA(ByteNFA(parse_regex(json_schema_to_regex(schema, whitespace=r"[ \n]{0,2}"))))
    assert loose.matches(b'{\n "a": [ 1,\n 2 ]\n}') and not loose.matches(b'{   "a":[]}')


@pytest.mark.parametrize("schema, message", [
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
     "recursive"),
    ({"not": {"type": "string"}}, "'not' is not supported"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "number", "minimum": 0}, "minimum/maximum on numbers"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required property 'b'"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "no integer"),
    ({"type": "str"}, "unknown type 'str'"),
    ({"enum": []}, "enum must be a non-empty list"),
    ({"$ref": "http://example.com/s.json"}, "only local"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"type": "string", "maxLength": -1}, "maxLength must be a non-negative integer"),
    ("{not json", "not valid JSON"),
    (17, "must be an object or a boolean"),
    (False, "matches nothing"),
])
def test_unsupported_or_invalid_schema_is_named(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        json_schema_to_regex(schema)


def test_integer_ranges_against_python():
    rng = random.Random(0)
    for _ in range(300):
        lo = rng.choice([None, rng.randint(-3000, 3000), rng.randint(-15, 15), 0, 1, -1])
        hi = rng.choice([None, rng.randint(-3000, 3000), rng.randint(-15, 15), 0, 1, -1])
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        compiled = re.compile(int_range_regex(lo, hi))
        for n in [*range(-40, 40), *range(-4000, 4000, 97), 10**9, -(10**9), lo or 0, hi or 0]:
            want = (lo is None or n >= lo) and (hi is None or n <= hi)
            assert bool(compiled.fullmatch(str(n))) == want, (lo, hi, n)
        for text in ["-0", "01", "-01", "00", "", "+1"]:
            assert not compiled.fullmatch(text), (lo, hi, text)


def test_properties_come_in_schema_order_and_only_those():
    """Stricter than the schema, by design: one order, no extra keys (what is generated)."""
    _, dfa = _matcher(PERSON)
    assert dfa.matches(json.dumps({"name": "A", "age": 1, "alive": True}).encode())
    assert not dfa.matches(json.dumps({"age": 1, "name": "A"}).encode())
    assert not dfa.matches(json.dumps({"name": "A", "age": 1, "extra": 0}).encode())
