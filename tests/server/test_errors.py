"""Client mistakes get 4xx in OpenAI's error shape, never a 5xx; the API key is enforced."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, live_server


def post(server, path: str, body=None, *, content: bytes | None = None, headers=None):
    return httpx.post(server.url + path, json=body if content is None else None,
                      content=content, headers=headers, timeout=30)


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    for n in needles:
        assert n in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_malformed_json(server):
    for raw in (b"{", b"{'prompt': 1}", b"\xff\xfe", b"", b"[" * 100_000):
        assert_error(post(server, "/v1/completions", content=raw), 400)
    assert_error(post(server, "/v1/completions", content=b"[1, 2]"), 400, "JSON object")
    assert_error(post(server, "/v1/chat/completions", content=b"null"), 400, "JSON object")


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], ["ok", ""]])
def test_empty_prompt(server, prompt):
    assert_error(post(server, "/v1/completions", {"model": server.model, "prompt": prompt}),
                 400, "empty", param="prompt")


def test_empty_messages(server):
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, param="messages")


def test_too_long_states_both_numbers(server):
    ids = list(range(3, 123))  # 120 tokens
    err = assert_error(post(server, "/v1/completions",
                            {"prompt": ids, "max_tokens": 20}), 400, param="max_tokens")
    for number in (str(MAX_MODEL_LEN), "120", "20"):
        assert number in err["message"]
    assert "maximum context length" in err["message"]
    # The prompt alone fills the context (chat, no max_tokens).
    long_text = "one two three four five six seven eight nine ten " * 30
    err = assert_error(post(server, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": long_text}]}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and "prompt has" in err["message"]
    # Through the official client: a BadRequestError, not a retry loop on 5xx.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=server.model, prompt=ids, max_tokens=100)


@pytest.mark.parametrize("field, value, needle", [
    ("temperature", -1.0, "temperature"),
    ("temperature", "hot", "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("n", 0, "n"),
    ("n", 17, "n must be at most 16"),
    ("n", True, "n"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", "ten", "max_tokens"),
    ("max_tokens", 10**30, "max_tokens"),
    ("logprobs", 21, "logprobs"),
    ("presence_penalty", 3.0, "presence_penalty"),
    ("stop", [""], "stop"),
    ("stop", 5, "stop"),
    ("top_k", -2, "top_k"),
    ("min_p", 2.0, "min_p"),
    ("seed", 2**64, "seed"),
    ("stream", "yes", "stream"),
    ("echo", "yes", "echo"),
    ("prompt", [5, 300], "outside the vocabulary"),
    ("logit_bias", {"abc": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {"300": 1}, "token ids in [0, 256)"),
    ("logit_bias", {"-1": 1}, "logit_bias keys"),
    ("logit_bias", {"5": 200}, "[-100, 100]"),
    ("logit_bias", {"5": "x"}, "logit_bias"),
    ("logit_bias", [5], "logit_bias"),
    ("allowed_token_ids", [5, 256], "allowed_token_ids must be token ids in [0, 256)"),
    ("allowed_token_ids", [], "allowed_token_ids"),
    ("prompt", {"text": "hi"}, "prompt"),
])
def test_invalid_parameters(server, field, value, needle):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, field: value}
    assert_error(post(server, "/v1/completions", body), 400, needle)


@pytest.mark.parametrize("body, needle", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "role"),
    # an image part for a text model (images: tests/server/test_llava_server.py), one of
    # the wrong shape, a part of another type by its type
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages.0.content must be a string or a list of {\"type\": \"text\""),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "image_url content parts given, but this model (LlamaForCausalLM) takes no image input"),
    ({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]},
     "video_url content parts given, but this model (LlamaForCausalLM) takes no video input"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "input_audio content parts given, but this model (LlamaForCausalLM) takes no audio input"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
     "content.0 has type 'file': only text, image_url, video_url, audio_url and input_audio parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
])
def test_invalid_chat(server, body, needle):
    assert_error(post(server, "/v1/chat/completions", body), 400, needle)


def test_unknown_model(server):
    err = assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404,
                       "gpt-9", param="model")
    assert err["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_routes_and_methods(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)
    assert_error(httpx.get(server.url + "/tokenize"), 405)
    assert_error(httpx.get(server.url + "/docs"), 404)  # no schema or docs side doors
    assert_error(httpx.get(server.url + "/openapi.json"), 404)
    assert httpx.get(server.url + "/health").status_code == 200


def test_body_size_limit(server):
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    assert_error(post(server, "/v1/completions", content=big), 413, "limit")
    # Chunked upload (no Content-Length): counted while reading.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * (64 << 10)
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert_error(r, 413, "limit")


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    with live_server(tiny_model_dir, api_key="s3cret-key") as s:
        yield s


def test_api_key(keyed_server):
    s = keyed_server
    body = {"model": s.model, "prompt": "hi", "max_tokens": 2}
    url = s.url + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                    {"Authorization": "Basic s3cret-key"}, {"Authorization": "Bearer s3cret-ke"}):
        err = assert_error(httpx.post(url, json=body, headers=headers), 401, "API key")
        assert err["code"] == "invalid_api_key"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    assert_error(httpx.get(s.url + "/v1/models"), 401)
    assert_error(httpx.get(s.url + "/metrics"), 401)
    assert_error(httpx.post(s.url + "/tokenize", json={"prompt": "hi"}), 401)
    assert_error(httpx.post(s.url + "/detokenize", json={"tokens": [5]}), 401)
    for method, path in (("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/f"),
                         ("GET", "/v1/files/f/content"), ("DELETE", "/v1/files/f"),
                         ("POST", "/v1/batches"), ("GET", "/v1/batches"),
                         ("GET", "/v1/batches/b"), ("POST", "/v1/batches/b/cancel")):
        assert_error(httpx.request(method, s.url + path), 401)
    assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    assert httpx.get(s.url + "/health").status_code == 200
    # The key is checked before the body is even parsed.
    assert_error(httpx.post(url, content=b"{", headers={"Authorization": "Bearer no"}), 401)

    bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=s.model, prompt="hi", max_tokens=2)
    good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret-key", max_retries=0)
    assert good.completions.create(model=s.model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_failed_step_fails_its_requests_and_the_server_goes_on(server, monkeypatch):
    """A step that raises (a bug, a device error) ends the requests in it with 503 / an SSE
    error event; the engine thread survives and the next request is served."""
    engine = server.async_engine.engine
    real_step = engine.step
    fail = {"left": 0}

    def step():
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    body = {"model": server.model, "prompt": "hello", "max_tokens": 4}
    fail["left"] = 1
    err = assert_error(post(server, "/v1/completions", body), 503, "injected failure")
    assert err["type"] == "server_error"
    fail["left"] = 1
    r = post(server, "/v1/completions", dict(body, stream=True))
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert "injected failure" in events[-2] and events[-1] == "[DONE]"
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200
