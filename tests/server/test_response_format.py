"""Structured outputs through the server: OpenAI's response_format on chat, vLLM's
guided_* and structured_outputs on both endpoints (and the official client), streamed
and not; bad specs are a 400 naming the field; nothing is left running afterwards."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import LiveServer, live_server

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
                   "sunny": {"type": "boolean"}},
    "required": ["city", "temperature"],
}
MESSAGES = [{"role": "user", "content": "The weather in Paris, as JSON."}]
PARENS = 'root ::= "(" inner ")"\ninner ::= ("x" | "(" inner ")")*'  # recursive: a pushdown guide
LIST_LARK = 'start: "[" [WORD (", " WORD)*] "]"\nWORD: /[a-z]+/'


def _balanced(text: str) -> bool:
    depth = 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth <= 0 and i < len(text) - 1:
            return False
    return depth == 0


@pytest.fixture(scope="module")
def json_server(byte_model_dir) -> Iterator[LiveServer]:
    with live_server(byte_model_dir) as s:
        yield s


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60)


@pytest.mark.parametrize("seed", range(3))
def test_chat_json_schema_returns_valid_json(json_server, seed):
    r = _post(json_server, "/v1/chat/completions", {
        "messages": MESSAGES, "temperature": 1.0, "seed": seed, "max_tokens": 80,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_chat_json_object_and_text(json_server):
    r = _post(json_server, "/v1/chat/completions", {
        "messages": MESSAGES, "temperature": 0, "max_tokens": 60, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    text = c["message"]["content"]
    assert text.startswith("{")
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    r = _post(json_server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"\d{3}-[a-z]{2,4}", lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
    ("guided_choice", ["alpha", "beta", "gamma"], lambda t: t in ("alpha", "beta", "gamma")),
    ("guided_json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ("structured_outputs", {"regex": "(ab|cd){2}!"}, lambda t: re.fullmatch("(ab|cd){2}!", t)),
    ("structured_outputs", {"json": json.dumps(SCHEMA)},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("structured_outputs", {"grammar": PARENS}, lambda t: re.fullmatch(r"[(x)]+", t) and _balanced(t)),
    ("guided_grammar", LIST_LARK, lambda t: re.fullmatch(r"\[([a-z]+(, [a-z]+)*)?\]", t)),
])
def test_vllm_fields_on_both_endpoints(json_server, path, field, value, check):
    body: dict = {field: value, "temperature": 1.0, "seed": 3, "max_tokens": 80, "n": 2}
    body.update({"prompt": "Answer:"} if path == "/v1/completions" else {"messages": MESSAGES})
    r = _post(json_server, path, body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        text = c["text"] if path == "/v1/completions" else c["message"]["content"]
        assert c["finish_reason"] == "stop" and check(text), text


def test_streamed_json_schema(json_server):
    with httpx.stream("POST", json_server.url + "/v1/chat/completions", timeout=60, json={
            "model": json_server.model, "messages": MESSAGES, "stream": True, "temperature": 1.0,
            "seed": 9, "max_tokens": 80,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_official_client(json_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=json_server.url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model=json_server.model, messages=MESSAGES, temperature=1.0, seed=4, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    r2 = client.completions.create(model=json_server.model, prompt="Pick:", max_tokens=10,
                                   extra_body={"guided_choice": ["red", "blue"]})
    assert r2.choices[0].text in ("red", "blue")


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "(ab"}, "guided_regex", "missing \\)"),
    ({"guided_regex": "a(?=b)"}, "guided_regex", "lookaround"),
    ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "object", "not": {}}}, "guided_json", "'not' is not supported"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "rule 'x' is used"),
    ({"guided_grammar": "start: a\na: a \"b\" | \"b\""}, "guided_grammar", "left-recursive"),
    ({"guided_grammar": "root ::= (\"a\""}, "guided_grammar", "missing '\\)' .* line 1, column 10"),
    ({"structured_outputs": {"grammar": 3}}, "structured_outputs.grammar", "valid string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
     "response_format", "points at nothing"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "one way"),
])
def test_bad_specs_are_400_naming_the_field(json_server, body, param, message):
    r = _post(json_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(message, err["message"]), err
    m = json_server.wait_idle()
    assert m["flashpage:kv_cache_blocks_used"] == 0


def test_a_new_spec_compiles_off_the_engine_thread(json_server, monkeypatch):
    """The server compiles a request's structured-outputs spec on a worker thread before
    adding it: the engine thread, which steps every request, only finds it cached."""
    import threading

    from flashpage.structured.compiler import GuideCompiler

    misses: list[str] = []
    real = GuideCompiler.compile

    def spy(self, spec):
        if spec.cache_key() not in self._guides:
            misses.append(threading.current_thread().name)
        return real(self, spec)

    monkeypatch.setattr(GuideCompiler, "compile", spy)
    r = _post(json_server, "/v1/completions", {"prompt": "Answer:", "guided_regex": "(zz|yy)[0-9]{3}", "max_tokens": 20})
    assert r.status_code == 200, r.text
    assert re.fullmatch("(zz|yy)[0-9]{3}", r.json()["choices"][0]["text"])
    assert misses and all(name.startswith("flashpage-guides") for name in misses), misses
    bad = _post(json_server, "/v1/completions", {"prompt": "x", "guided_regex": "a(?=b)", "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
