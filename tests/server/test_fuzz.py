"""Property-based fuzz of the API: whatever the body, no 5xx, and the server stays healthy
(answers, frees every block) afterwards."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Any JSON value (NaN and infinities included: Python's json writes them).
json_values = st.recursive(
    st.none() | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 16, 17, 20, 21, 127, 128, 255, 256, 2**31, 2**63, 2**64])
    | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
text = st.text(alphabet="abcdefghij klmnopqrstuvwxyz,.?!", min_size=1, max_size=24)
token_ids = st.lists(st.integers(min_value=3, max_value=255), min_size=1, max_size=8)

SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"enum": ["one", "two"]},
           {"type": "string", "maxLength": 3}, '{"type": "boolean"}', {"not": {}}, {"$ref": "#/x"}]

# field -> a strategy of valid values. A body is valid, valid but for one field, or chaos.
COMMON = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(min_value=1, max_value=4),
    "temperature": st.floats(min_value=0.0, max_value=2.0),
    "top_p": st.floats(min_value=0.05, max_value=1.0),
    "n": st.integers(min_value=1, max_value=3),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "top_k": st.integers(min_value=-1, max_value=300),
    "min_p": st.floats(min_value=0.0, max_value=1.0),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2.0),
    "min_tokens": st.integers(min_value=0, max_value=1),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(min_value=0, max_value=255).map(str),
                                  st.floats(min_value=-100, max_value=100), max_size=3),
    "prompt_logprobs": st.integers(min_value=0, max_value=3),
    "allowed_token_ids": st.lists(st.integers(min_value=0, max_value=255), min_size=1, max_size=4),
    "truncate_prompt_tokens": st.integers(min_value=1, max_value=40),
}
# At most one of these per body (several at once is a 400 of its own, drawn by "chaos").
STRUCTURED = {
    "guided_regex": st.sampled_from([r"\d+", "(yes|no)", "[a-z ]{1,8}", "(", "a(?=b)", "", "x{2,1}"]),
    "guided_choice": st.lists(text, min_size=1, max_size=3),
    "guided_json": st.sampled_from(SCHEMAS),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"choice": st.lists(text, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"regex": st.sampled_from(["[a-z]+", "the (quick|lazy)"])}),
        st.fixed_dictionaries({"json": st.sampled_from(SCHEMAS)}),
        st.fixed_dictionaries({"json_object": st.booleans()})),
}
COMPLETIONS = dict(COMMON, **{
    "prompt": st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids,
                        st.lists(token_ids, min_size=1, max_size=3)),
    "logprobs": st.integers(min_value=0, max_value=5),
    "echo": st.booleans(),
})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={"content": st.one_of(text, st.none(), st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2))})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_x", "g-1"])},
    optional={"parameters": st.sampled_from([x for x in SCHEMAS if isinstance(x, dict)]),
              "description": text})})
CHAT = dict(COMMON, **{
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(min_value=1, max_value=4),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=5),
    "tools": st.lists(tool, min_size=1, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})})),
    "parallel_tool_calls": st.booleans(),
})
CHAT_STRUCTURED = dict(STRUCTURED, **{
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("x"), "schema": st.sampled_from([x for x in SCHEMAS if isinstance(x, dict)])},
            optional={"strict": st.booleans()})})),
})
REQUIRED = {"prompt", "messages"}
EDGES = st.sampled_from([None, True, False, 0, -1, 1, 17, 21, 129, 256, 2**63, 2**64, -(2**64),
                         0.0, -0.0, 1e-300, 1e300, float("nan"), float("inf"), "", "x", [], {},
                         [[]], [""], [0], [-1], [256], [1.5], {"a": 1}])


@st.composite
def bodies(draw, fields: dict, structured: dict) -> dict:
    mode = draw(st.sampled_from(["valid", "one_bad", "one_bad", "chaos"]))
    body = {}
    for name, valid in fields.items():
        if name in REQUIRED or draw(st.booleans()):
            body[name] = draw(valid)
    if draw(st.integers(0, 2)) == 0:
        name = draw(st.sampled_from(sorted(structured)))
        body[name] = draw(structured[name])
    fields = dict(fields, **structured)
    if mode == "one_bad":
        name = draw(st.sampled_from(sorted(fields)))
        if draw(st.booleans()):
            body[name] = draw(st.one_of(EDGES, json_values))
        else:
            body.pop(name, None)
    elif mode == "chaos":
        for name in fields:
            if draw(st.integers(0, 3)) == 0:
                body[name] = draw(st.one_of(EDGES, json_values))
    # Keep generation short: a chat without max tokens would fill the context.
    if "messages" in fields and "max_tokens" not in body:
        body.setdefault("max_completion_tokens", 3)
    if draw(st.integers(0, 4)) == 0:  # unknown fields are ignored
        body.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)))
    return body


EMBEDDINGS = {"input": st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids,
                                 st.lists(token_ids, min_size=1, max_size=3)),
              "encoding_format": st.sampled_from(["float", "base64"]),
              "dimensions": st.integers(min_value=1, max_value=80),
              "truncate_prompt_tokens": st.integers(min_value=1, max_value=40)}


@st.composite
def embedding_bodies(draw) -> dict:
    body = {name: draw(valid) for name, valid in EMBEDDINGS.items() if name == "input" or draw(st.booleans())}
    if draw(st.booleans()):
        body[draw(st.sampled_from(sorted(EMBEDDINGS)))] = draw(st.one_of(EDGES, json_values))
    return body


requests_ = st.one_of(
    st.tuples(st.just("/v1/embeddings"), embedding_bodies().map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/completions"), bodies(COMPLETIONS, STRUCTURED).map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, CHAT_STRUCTURED).map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.one_of(st.binary(max_size=64),
                        json_values.map(lambda v: json.dumps(v).encode()))),
)


def check_response(r: httpx.Response, body: bytes) -> None:
    assert r.status_code < 500, (r.status_code, r.text, body[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    elif r.json().get("object") == "list":  # /v1/embeddings
        assert r.json()["data"] and all(d["embedding"] for d in r.json()["data"]), r.text
    else:
        assert r.json()["choices"], r.text


def server_errors(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith('flashpage:http_errors_total{status="5'))


def test_fuzz_no_5xx(server):
    errors_before = server_errors(server.metrics())
    client = httpx.Client(base_url=server.url, timeout=60)

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(requests_)
    def one(req: tuple[str, bytes]) -> None:
        path, body = req
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        check_response(r, body)

    try:
        one()
    finally:
        client.close()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = server.wait_idle()
    assert m["flashpage:kv_cache_blocks_used"] == 0 and m["flashpage:num_requests_running"] == 0
    assert server_errors(m) == errors_before
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": server.model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
