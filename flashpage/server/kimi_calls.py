"""``kimi_k2`` tool calls (vLLM's ``--tool-call-parser kimi_k2``: Kimi K2 with its chat
template): after the content, the calls between Kimi's special tokens, each its id and a JSON
object of arguments::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>

The id is ``functions.NAME:INDEX`` (or ``NAME:INDEX``) and, as in vLLM, becomes the call's
``id``; the name is what comes before the ``:``, after its last ``.``. Whitespace around
the tokens, the id and the arguments is allowed; the closing ``<|tool_calls_section_end|>``
may be missing at the very end. Text before and after the calls is the content; a call that
does not read so makes the whole answer content. Read and streamed by DeepSeek's reader
(server/deepseek_calls.py) with these tokens: the header once the id is complete, then the
arguments' canonical JSON piece by piece.
"""

from __future__ import annotations

import re

from flashpage.server.deepseek_calls import DeepSeekV3Parser, SectionReader

CALLS_BEGIN, CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
_ID = re.compile(r"[^:]+:\d+")


def name_of(call_id: str) -> str:
    """vLLM's reading of a call id: ``functions.get_weather:0`` -> ``get_weather``."""
    return call_id.split(":")[0].split(".")[-1]


class KimiK2Parser(DeepSeekV3Parser):
    name = "kimi_k2"
    CALLS_BEGIN = CALLS_BEGIN

    def reader(self) -> SectionReader:
        return _KimiReader()


class _KimiReader(SectionReader):
    """Kimi's header: id -> (ID argument begin) args; after them: call_end."""

    CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END
    HEADER = "id"

    def _id(self, text: str) -> bool:
        call_id = self._upto(text, ARGS_BEGIN, "<")
        if call_id is None:
            return False
        if not _ID.fullmatch(call_id) or not name_of(call_id):
            self.dead = True
            return False
        self.call_id, self.name, self.state = call_id, name_of(call_id), "args"
        return True
