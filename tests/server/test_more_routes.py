"""vLLM's remaining small routes: SageMaker's /ping (GET and POST, no key, 503 without an
engine) and /invocations (the body's shape picks chat, completions, embeddings, score or
rerank, streaming too; the key needed; a 400 naming the shapes otherwise), /pooling (the
embeddings route's vectors as floats or base64; a classifier's class probabilities), and
--enable-log-requests (one INFO line at arrival and one at finish, no prompt text),
/reset_prefix_cache (the next identical prompt computed again; refused while requests
hold blocks)."""

from __future__ import annotations

import base64
import logging
import struct

import httpx
import pytest

from flashpage.cli import build_parser
from tests.server.conftest import live_server

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60, **kw)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health(server, method, monkeypatch):
    r = httpx.request(method, server.url + "/ping", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    monkeypatch.setattr(server.async_engine, "dead", RuntimeError("gone"))  # is_running: False
    r = httpx.request(method, server.url + "/ping", timeout=10)
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_ping_without_a_key_invocations_with_one(tiny_model_dir):
    with live_server(tiny_model_dir, api_key="k3y") as s:
        assert httpx.get(s.url + "/ping").status_code == 200
        assert httpx.post(s.url + "/ping").status_code == 200
        r = httpx.post(s.url + "/invocations", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
        r = httpx.post(s.url + "/pooling", json={"input": "hi"})
        assert r.status_code == 401
        r = httpx.post(s.url + "/invocations", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer k3y"}, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == "text_completion"


def test_invocations_dispatch_by_shape(server):
    chat = _post(server, "/invocations", CHAT)
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    cmpl = _post(server, "/invocations", {"prompt": "the quick", "max_tokens": 2})
    assert cmpl.status_code == 200 and cmpl.json()["object"] == "text_completion"
    # temperature 0: the same tokens as the completions route itself
    body = {"prompt": "the quick brown", "max_tokens": 4, "temperature": 0}
    direct = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert _post(server, "/invocations", body).json()["choices"][0]["text"] == direct
    embd = _post(server, "/invocations", {"input": ["a lazy dog", "hello"]})
    assert embd.status_code == 200 and [d["object"] for d in embd.json()["data"]] == ["embedding"] * 2
    want = _post(server, "/v1/embeddings", {"input": ["a lazy dog", "hello"]}).json()["data"]
    for got, ref in zip(embd.json()["data"], want, strict=True):
        assert got["embedding"] == pytest.approx(ref["embedding"], abs=1e-5)
    score = _post(server, "/invocations", {"text_1": "fox", "text_2": ["dog", "fox"]})
    assert score.status_code == 200 and len(score.json()["data"]) == 2
    rerank = _post(server, "/invocations", {"query": "fox", "documents": ["dog", "fox"]})
    assert rerank.status_code == 200 and len(rerank.json()["results"]) == 2
    server.wait_idle()


def test_invocations_streams(server):
    r = _post(server, "/invocations", {**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"chat.completion.chunk"' in events[0]


@pytest.mark.parametrize("body", [{"foo": 1}, {"messages": "not a list"}, {}])
def test_invocations_bad_body_names_the_shapes(server, body):
    r = httpx.post(server.url + "/invocations", json=body, timeout=30)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "ChatCompletionRequest" in msg and "CompletionRequest" in msg and "EmbeddingRequest" in msg


def test_invocations_malformed_json_and_unknown_model(server):
    r = httpx.post(server.url + "/invocations", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/invocations", json={**CHAT, "model": "nope"}, timeout=30)
    assert r.status_code == 404


def test_pooling_float_and_base64_equal_embeddings(server):
    texts = ["the quick brown fox", "jumps over"]
    ref = _post(server, "/v1/embeddings", {"input": texts}).json()
    r = _post(server, "/pooling", {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model
    assert body["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert body["usage"]["total_tokens"] == ref["usage"]["total_tokens"]
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    for got, want in zip(body["data"], ref["data"], strict=True):
        assert got["data"] == pytest.approx(want["embedding"], abs=1e-5)
    b64 = _post(server, "/pooling", {"input": texts[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["data"])
    vec = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert list(vec) == pytest.approx(ref["data"][0]["embedding"], abs=1e-5)
    for bad, param in (({"input": ""}, "input"), ({"input": "hi", "encoding_format": "int8"},
                                                  "encoding_format")):
        r = _post(server, "/pooling", bad)
        assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text


def test_pooling_and_invocations_on_a_classifier(tmp_path):
    from tests.models.test_decoder_classifier import ENGINE, build_classifier

    path = build_classifier(tmp_path / "cls3", "llama", 3)
    texts = ["the quick brown fox", "hello"]
    with live_server(path, engine_kw=ENGINE) as s:
        probs = [d["probs"] for d in _post(s, "/classify", {"input": texts}).json()["data"]]
        r = _post(s, "/pooling", {"input": texts})
        assert r.status_code == 200, r.text
        assert [d["data"] for d in r.json()["data"]] == [pytest.approx(p, abs=1e-6) for p in probs]
        r = _post(s, "/pooling", {"input": texts, "dimensions": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        r = _post(s, "/invocations", {"input": texts})  # "input" on a classifier: /classify
        assert r.status_code == 200, r.text
        assert [d["probs"] for d in r.json()["data"]] == [pytest.approx(p, abs=1e-6) for p in probs]
        s.wait_idle()


def test_log_requests(tiny_model_dir, caplog):
    long_prompt = "the quick brown fox jumps over the lazy dog " * 6  # > 100 characters
    caplog.set_level(logging.INFO, logger="flashpage.server.requests")
    with live_server(tiny_model_dir, log_requests=True) as s:
        r = _post(s, "/v1/completions", {"prompt": long_prompt, "max_tokens": 3, "min_tokens": 3,
                                         "temperature": 0.5, "seed": 7})
        assert r.status_code == 200, r.text
        n_prompt = r.json()["usage"]["prompt_tokens"]
        assert _post(s, "/invocations", {"input": "hello"}).status_code == 200
        s.wait_idle()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "flashpage.server.requests"]
    arrived = [m for m in lines if "arrived" in m]
    finished = [m for m in lines if "finished" in m]
    assert len(arrived) == 2 and len(finished) == 2, lines
    rid = arrived[0].split()[1]
    assert rid.startswith("cmpl-")
    assert "route=/v1/completions" in arrived[0] and f"prompt_tokens={n_prompt}" in arrived[0]
    assert "temperature=0.5" in arrived[0] and "max_tokens=3" in arrived[0] and "seed=7" in arrived[0]
    assert f"request {rid} finished: finish_reason=length, output_tokens=3" in finished
    assert "route=/invocations" in arrived[1] and "pooling(task=embed" in arrived[1]
    assert all("quick brown" not in m for m in lines)  # token ids arrive: no prompt text


def test_log_requests_an_abort(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="flashpage.server.requests")
    body = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with live_server(tiny_model_dir, log_requests=True) as s:
        with httpx.Client(timeout=30) as client, \
                client.stream("POST", s.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leave mid-stream: the request is aborted
        s.wait_idle()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "flashpage.server.requests"]
    assert len(lines) == 2 and "arrived" in lines[0] and "route=/v1/completions" in lines[0]
    assert lines[1].endswith("finish_reason=abort (client gone or cancelled)"), lines


def test_log_requests_off_by_default(server, caplog):
    caplog.set_level(logging.INFO, logger="flashpage.server.requests")
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if r.name == "flashpage.server.requests"]


def test_enable_log_requests_flag():
    assert build_parser().parse_args(["serve", "--enable-log-requests"]).enable_log_requests
    args = build_parser().parse_args(["serve", "--disable-log-requests"])
    assert args.disable_log_requests and not args.enable_log_requests


def test_reset_prefix_cache(server):
    engine = server.async_engine.engine
    prompt = {"prompt": "the same long prompt, word after word, " * 4, "max_tokens": 2}
    assert _post(server, "/v1/completions", prompt).status_code == 200
    assert _post(server, "/v1/completions", prompt).status_code == 200
    hits = engine.kv_manager.prefix_hits
    assert hits > 0  # the second run found the first's blocks
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert _post(server, "/v1/completions", prompt).status_code == 200
    assert engine.kv_manager.prefix_hits == hits  # nothing left to hit
    # the engine refuses while requests hold blocks (tests/engine/test_generation_vs_hf.py)
    engine.reset_prefix_cache = lambda: False
    try:
        r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    finally:
        del engine.reset_prefix_cache
    assert r.status_code == 409 and "hold KV blocks" in r.json()["error"]["message"]


def test_cache_salt_on_completions_and_chat(server):
    """vLLM's cache_salt field: a salted request hits only its own salt's blocks; an empty
    salt is a 400 naming the field."""
    engine = server.async_engine.engine
    kv = engine.kv_manager
    body = {"prompt": "a prompt long enough to fill several blocks of the cache " * 3,
            "max_tokens": 2}
    hits = kv.prefix_hits
    assert _post(server, "/v1/completions", {**body, "cache_salt": "s1"}).status_code == 200
    assert _post(server, "/v1/completions", {**body, "cache_salt": "s2"}).status_code == 200
    assert kv.prefix_hits == hits  # another salt: nothing shared
    assert _post(server, "/v1/completions", {**body, "cache_salt": "s1"}).status_code == 200
    assert kv.prefix_hits > hits
    r = _post(server, "/v1/chat/completions", {**CHAT, "cache_salt": "s3"})
    assert r.status_code == 200
    r = _post(server, "/v1/completions", {**body, "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.text
