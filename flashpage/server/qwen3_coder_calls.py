"""``qwen3_coder`` tool calls (vLLM's ``--tool-call-parser qwen3_coder``: Qwen3-Coder, Qwen3.5):
XML-like blocks, any number, text around them the message's content::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between ``<parameter=NAME>`` and the first ``</parameter>``
(one newline after the tag and one before the end dropped), read by the type the request's
tool gives that parameter in its JSON schema, as vLLM's parser reads it (``convert``):
string types keep the text; integer and number types parse it (a number that is whole
becomes an integer), keeping the text if it does not parse; boolean is whether it is
``true`` (any case); object and array parse it as JSON, else as a Python literal, else keep
the text; "null" / "None" is null for any type but a string (for a string too where the
schema allows null); other types try a Python literal, else the text. A parameter the tool
does not declare (or a function the request has no tool for) keeps its text. The call's
arguments are those values as a JSON object (server/partial_json.py's ``dumps``), every
parameter in order, a repeated one too.

Only whitespace may come between the tags; a ``<tool_call>`` whose contents are anything
else, or that the answer ends inside (before ``</function>``), makes the answer content. The
closing ``</tool_call>`` may be missing at the very end.

Streamed as written: a call's header once ``<function=NAME>`` is; a string parameter's value
character by character (held back only where it may be the start of ``</parameter>`` or
the newline before it), any other value once its ``</parameter>`` is read. The non-streamed
reading is this same reader run over the whole answer, so the two agree.

``qwen3_xml`` (vLLM's newer parser for the same model and tags, an XML parser) is this reader
with vLLM's qwen3_xml reading of the values (``convert_xml``): the type only from the
schema's ``type`` (no ``anyOf``, a list of types or a type it does not know read as
"string"); "null" null for every type, a string too ("None" is text); arrays read as Python
literals only (JSON's ``true`` keeps the text); objects as JSON, or as a Python literal
where the text has a ``'`` and a bracket. "null" is null here where vLLM's arguments text
has ``""`` for a string (its parsed parameters None) and nothing, not JSON, for other types;
an object that is not JSON, which vLLM writes in verbatim, is its text here. Its string values stream once they cannot be "null". Its
structure is read as qwen3_coder's (vLLM's XML parser also closes tags the model left open,
and takes a ``<function=`` without ``<tool_call>``; here those make the answer content).
"""

from __future__ import annotations

import json
import math
from typing import Any

from flashpage.server.partial_json import dumps, loads
from flashpage.server.pythonic_calls import literal
from flashpage.server.tool_stream import StreamedCall, TagReader, new_call_id
from flashpage.server.tools import ToolCall, ToolParser, _content, _prefix_at_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_WS = " \t\r\n"
_NOT_IN_NAME = set("{}<>\"' \t\r\n")  # vLLM's test of a function name (a template's {{ x }})
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _type(schema: Any) -> tuple[str, bool]:
    """A parameter schema's type as vLLM reads it (lower case; from ``anyOf``, or a list of
    types, the first that is not "null") and whether it admits null."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    else:
        types = [o["type"] for o in schema.get("anyOf", []) if isinstance(o, dict) and "type" in o]
    names = [str(t).strip().lower() for t in types]
    rest = [t for t in names if t != "null"]
    return (rest[0] if rest else names[0] if names else "string"), "null" in names


def _literal_or(text: str, then: Any) -> Any:
    try:
        return literal(text)
    except ValueError:
        return then


_INTEGERS = ("int", "uint", "long", "short", "unsigned")
_NUMBERS = (*_INTEGERS, "num", "float")
_BOOLEANS = ("boolean", "bool", "binary")


def _scalar(text: str, kind: str) -> Any:
    """An integer, number or boolean type's reading of a text (the text where it is not one)."""
    if kind.startswith(_INTEGERS):
        try:
            return int(text)
        except ValueError:
            return text
    if kind in _BOOLEANS:
        return text.lower() == "true"
    try:
        number = float(text)
    except ValueError:
        return text
    if not math.isfinite(number):
        return text
    return int(number) if number.is_integer() else number


def convert(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type says (None: the tool does not
    declare it: the text)."""
    if schema is None:
        return text
    kind, nullable = _type(schema)
    if text.lower() in ("null", "none") and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_NUMBERS) or kind in _BOOLEANS:
        return _scalar(text, kind)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:  # JSON; a JSON string that holds a Python literal read once more
            value = loads(text)
            return _literal_or(value, value) if isinstance(value, str) else value
        except ValueError:
            value = _literal_or(text, text)
            return _literal_or(value, value) if isinstance(value, str) and value is not text else value
    return _literal_or(text, text)


def _escaped(text: str) -> str:
    """Text as it is inside a JSON string (``json.dumps``, non-ASCII kept): character by
    character, so pieces of a string can go out as they come."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    READER: type[_Qwen3CoderReader]  # set below the readers

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.READER.OPEN not in text:
            return text, []
        reader = self.reader()
        reader.feed(text)
        if reader.dead or reader.state not in ("outside", "close"):
            return text, []
        outside, at = [], 0
        for start, end in reader.spans + [(len(text), len(text))]:
            outside.append(text[at:start])
            at = end if end is not None else len(text)
        calls = [ToolCall(c.name or "", c.partial) for c in reader.calls]
        return _content(*outside), calls

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.READER.OPEN)

    def reader(self) -> _Qwen3CoderReader:
        properties = {}
        for tool in self.tools:
            function = tool.get("function", {})
            params = function.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            properties[function.get("name")] = props if isinstance(props, dict) else {}
        return self.READER(properties)


class _Qwen3CoderReader(TagReader):
    """outside -> (``<tool_call>``) open -> (``<function=``) function -> (NAME ``>``) params;
    params -> (``<parameter=``) parameter -> (NAME ``>``) value0 -> value -> (``</parameter>``)
    params; params -> (``</function>``) close -> (``</tool_call>``) outside (OPEN and CLOSE:
    a subclass's own tags around the function)."""

    OPEN, CLOSE = OPEN, CLOSE

    def __init__(self, properties: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.properties = properties  # each tool's parameter schemas, by function name
        self.pos = 0
        self.state = "outside"
        self.spans: list[tuple[int, int | None]] = []  # each call's text (no end: to the end)
        self.call: StreamedCall | None = None
        self.params = 0  # the call's parameters so far
        self.schema: Any = None  # the parameter's (None: not declared)
        self.streams = False  # its value goes out as it comes (a string)
        self.quoted = False  # its opening quote went out
        self.value_at = self.sent = 0  # where its value starts, how far it went out

    def _streams(self, schema: Any) -> bool:
        """Whether a value of this schema is a string, going out as it comes."""
        kind, nullable = _type(schema)
        return schema is None or (kind in _STRING_TYPES and not nullable)

    def _holds(self, start: str) -> bool:
        """Whether a string value that starts so may yet be read otherwise (it waits)."""
        return False

    def _convert(self, text: str, schema: Any) -> Any:
        return convert(text, schema)

    def _name(self, text: str, bad: set[str]) -> str | None:
        """The name up to ``>``; None to wait (or dead)."""
        end = text.find(">", self.pos)
        name = text[self.pos:end if end >= 0 else len(text)]
        if any(c in bad for c in name) or end == self.pos:
            self.dead = True
            return None
        if end < 0:
            return None
        self.pos = end + 1
        return name

    def _outside(self, text: str) -> bool:
        i = text.find(self.OPEN, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(self.OPEN) + 1)
            return False
        self.spans.append((i, None))
        self.pos, self.state = i + len(self.OPEN), "open"
        return True

    def _open(self, text: str) -> bool:
        return self._expect(text, FUNCTION, "function")

    def _function(self, text: str) -> bool:
        name = self._name(text, _NOT_IN_NAME)
        if name is None:
            return False
        self.call, self.params, self.state = StreamedCall(new_call_id(), name), 0, "params"
        self.calls.append(self.call)
        return True

    def _params(self, text: str) -> bool:
        assert self.call is not None
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        if text.startswith(FUNCTION_END, self.pos):
            self.call.partial += "}" if self.params else "{}"
            self.pos, self.state = self.pos + len(FUNCTION_END), "close"
            return True
        if FUNCTION_END.startswith(text[self.pos:]):
            return False
        return self._expect(text, PARAMETER, "parameter")

    def _parameter(self, text: str) -> bool:
        assert self.call is not None
        key = self._name(text, set("<>\r\n"))
        if key is None:
            return False
        props = self.properties.get(self.call.name or "", {})
        self.schema = props.get(key)
        self.streams = self._streams(self.schema)
        self.call.partial += ("{" if not self.params else ", ") + dumps(key) + ": "
        self.quoted = self.streams and not self._holds("")
        self.call.partial += '"' if self.quoted else ""
        self.params += 1
        self.state = "value0"
        return True

    def _value0(self, text: str) -> bool:
        self.pos += text[self.pos] == "\n"  # the newline after the tag is not the value's
        self.value_at = self.sent = self.pos  # pos: where </parameter> is looked for
        self.state = "value"
        return True

    def _value(self, text: str) -> bool:
        assert self.call is not None
        end = text.find(PARAMETER_END, self.pos)
        if end < 0:  # what may not be the value's yet: a start of </parameter>, the newline before it
            self.pos = max(self.value_at, len(text) - len(PARAMETER_END) + 1)
            if self.streams:
                cut = self.pos + _prefix_at_end(text[self.pos:], PARAMETER_END)
                cut -= cut > self.value_at and text[cut - 1] == "\n"
                if cut > self.sent and (self.quoted or not self._holds(text[self.value_at:cut])):
                    self.call.partial += ("" if self.quoted else '"') + _escaped(text[self.sent:cut])
                    self.sent, self.quoted = cut, True
            return False
        value = text[self.value_at:end]
        value = value[:-1] if value.endswith("\n") else value
        if self.streams and self.quoted:
            self.call.partial += _escaped(value[self.sent - self.value_at:]) + '"'
        else:
            self.call.partial += dumps(self._convert(value, self.schema))
        self.pos, self.state = end + len(PARAMETER_END), "params"
        return True

    def _close(self, text: str) -> bool:
        if not self._expect(text, self.CLOSE, "outside"):
            return False
        self.spans[-1] = (self.spans[-1][0], self.pos)
        return True


# vLLM's qwen3_xml: the same tags, each value read as vLLM's qwen3_xml parser reads it
_XML_CONTAINERS = ("array", "arr", "sequence")


def xml_kind(schema: Any) -> str:
    """A parameter schema's type as vLLM's qwen3_xml reads it: its ``type`` as written (no
    ``anyOf``; a list of types is not one), a type it does not know (or none: an undeclared
    parameter, a tool the request does not have) "string"."""
    kind = str(schema.get("type", "string")) if isinstance(schema, dict) else "string"
    known = (kind in _STRING_TYPES or kind in _BOOLEANS or kind == "object" or kind in _XML_CONTAINERS
             or kind.startswith((*_NUMBERS, "dict", "list")))
    return kind.strip().lower() if known else "string"


def convert_xml(text: str, schema: Any) -> Any:
    """A parameter's text as vLLM's qwen3_xml reads it: "null" (any case) null whatever the
    type; strings their text; integers, numbers and booleans as ``convert``; an array
    (``list...``, ``dict...``, ``sequence``) a Python literal, else its text; an object JSON,
    or a Python literal where it has a quote ``'`` and a bracket, else its text."""
    kind = xml_kind(schema)
    if text.lower() == "null":
        return None
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_NUMBERS) or kind in _BOOLEANS:
        return _scalar(text, kind)
    if kind == "object" and not ("'" in text and any(c in text for c in "[{(")):
        try:
            return loads(text)
        except ValueError:
            return text
    return _literal_or(text, text)


class _Qwen3XmlReader(_Qwen3CoderReader):
    """qwen3_coder's reader with qwen3_xml's values: every string streams, its opening quote
    held while the value may still be "null"."""

    def _streams(self, schema: Any) -> bool:
        return xml_kind(schema) in _STRING_TYPES

    def _holds(self, start: str) -> bool:
        return "null".startswith(start.lower())

    def _convert(self, text: str, schema: Any) -> Any:
        return convert_xml(text, schema)


class Qwen3XmlParser(Qwen3CoderParser):
    name = "qwen3_xml"
    READER = _Qwen3XmlReader


Qwen3CoderParser.READER = _Qwen3CoderReader
