"""``seed_oss`` tool calls (vLLM's ``--tool-call-parser seed_oss``: ByteDance Seed-OSS):
qwen3_coder's function and parameter tags inside Seed's own, any number, text around them
the message's content::

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </seed:tool_call>

Read and streamed by qwen3_coder's reader (server/qwen3_coder_calls.py) with these tags; a
parameter's value is read as vLLM's seed_oss parser reads it (``convert_seed``): "null" (any
case) null for every type, a string too; the type only from the schema's ``type`` (a string
where there is none); string types the text; integer, number and boolean types as
qwen3_coder's; objects (``object``, ``dict...``) as JSON, else as a Python literal; any other
type (arrays, a type vLLM does not know) a Python literal, else the text; a parameter the
tool does not declare (or a tool the request lacks) its text. String values stream once they
cannot be "null". vLLM also reads only the calls after ``</seed:think>`` where the answer
has ``<seed:think>`` (Seed's reasoning, its reasoning parser's part), takes a tool's
``parameters`` without ``properties`` as the properties themselves, and, where no
``<seed:tool_call>`` is written, reads ``<function=`` blocks alone; here those are not done.
"""

from __future__ import annotations

from typing import Any

from flashpage.server.partial_json import loads
from flashpage.server.qwen3_coder_calls import (
    _BOOLEANS,
    _NUMBERS,
    _STRING_TYPES,
    Qwen3CoderParser,
    _literal_or,
    _Qwen3XmlReader,
    _scalar,
)

OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"


def seed_kind(schema: Any) -> str:
    """A parameter schema's type as vLLM's seed_oss reads it: its ``type``, lower case, else
    "string"."""
    return str(schema["type"]).strip().lower() if isinstance(schema, dict) and "type" in schema else "string"


def convert_seed(text: str, schema: Any) -> Any:
    """A parameter's text as vLLM's seed_oss reads it (None: the tool does not declare it)."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = seed_kind(schema)
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_NUMBERS) or kind in _BOOLEANS:
        return _scalar(text, kind)
    if kind == "object" or kind.startswith("dict"):
        try:
            return loads(text)
        except ValueError:
            pass
    return _literal_or(text, text)


class _SeedReader(_Qwen3XmlReader):
    """qwen3_xml's reader (a string's opening quote held while it may be "null") with Seed's
    tags and values."""

    OPEN, CLOSE = OPEN, CLOSE

    def _streams(self, schema: Any) -> bool:
        return seed_kind(schema) in _STRING_TYPES

    def _convert(self, text: str, schema: Any) -> Any:
        return convert_seed(text, schema)


class SeedOssParser(Qwen3CoderParser):
    name = "seed_oss"
    READER = _SeedReader
