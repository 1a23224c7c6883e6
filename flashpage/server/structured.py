"""The ways an OpenAI-compatible request asks for structured outputs, read into one
StructuredOutputsParams: OpenAI's ``response_format`` (json_object, json_schema), vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` (before 0.10) and
``structured_outputs`` (0.10 on). A request uses at most one; anything wrong is a 400
naming the field it came from (the spec's compile errors too: ``start`` is told the field).
"""

from __future__ import annotations

from typing import Any

from flashpage.sampling_params import StructuredOutputsError, StructuredOutputsParams
from flashpage.server.protocol import ChatCompletionRequest, CompletionRequest, bad_request

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The field the request's structured-outputs spec comes from (None: none); 400 if
    several ask."""
    asked = [f for f in _GUIDED if getattr(req, f) is not None]
    if req.structured_outputs is not None:
        asked.append("structured_outputs")
    if req.response_format is not None and req.response_format.type != "text":
        asked.append("response_format")
    if len(asked) > 1:
        raise bad_request(f"ask for structured outputs one way, not {' and '.join(asked)}", asked[1])
    return asked[0] if asked else None


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's StructuredOutputsParams, or None; a 400 naming the field if invalid."""
    field = structured_field(req)
    if field is None:
        return None
    kw: dict[str, Any]
    if field == "response_format":
        rf = req.response_format
        assert rf is not None
        if rf.type == "json_object":
            kw = dict(json_object=True)
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", field)
        else:
            kw = dict(json=rf.json_schema.schema_)
    elif field == "structured_outputs":
        so = req.structured_outputs
        assert so is not None
        kw = dict(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                  json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                  whitespace_pattern=so.whitespace_pattern)
    else:
        kw = {field.removeprefix("guided_"): getattr(req, field),
              "whitespace_pattern": req.guided_whitespace_pattern}
    try:
        return StructuredOutputsParams(**kw)
    except StructuredOutputsError as e:
        raise bad_request(str(e), field) from None
