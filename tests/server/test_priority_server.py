"""The ``priority`` request field (vLLM's) on completions, chat, embeddings, score and rerank:
an integer, reaching the engine with the priority scheduling policy; under fcfs (the
default) anything but 0 is a 400, as vLLM answers."""

from __future__ import annotations

import pytest

from tests.server.conftest import live_server
from tests.server.test_errors import assert_error, post

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
ENDPOINTS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
DOCS = ["the quick brown fox", "jumps over the lazy dog", "a quick brown fox"]
EMBED = {"input": DOCS}
SCORE = {"text_1": DOCS[0], "text_2": DOCS}
RERANK = {"query": DOCS[2], "documents": DOCS}
# the pooling endpoints (every alias): the field and its rules are the completions'
POOLING = [("/v1/embeddings", EMBED), ("/score", SCORE), ("/v1/score", SCORE),
           ("/rerank", RERANK), ("/v1/rerank", RERANK), ("/v2/rerank", RERANK)]


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir):
    with live_server(tiny_model_dir, engine_kw={"scheduling_policy": "priority"}) as s:
        yield s


def _text(r) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_fcfs_takes_priority_zero_only(server, path, body):
    assert _text(post(server, path, {**body, "priority": 0}))
    err = assert_error(post(server, path, {**body, "priority": 3}), 400,
                       "Got priority 3 but priority scheduling is not enabled",
                       "--scheduling-policy priority", param="priority")
    assert err["type"] == "invalid_request_error"
    assert_error(post(server, path, {**body, "priority": -1, "stream": True}), 400,
                 "Got priority -1", param="priority")
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


@pytest.mark.parametrize("path, body", ENDPOINTS + POOLING)
@pytest.mark.parametrize("value", ["1", 1.5, True, None, [1], 2**63])
def test_priority_must_be_an_integer(server, priority_server, path, body, value):
    for s in (server, priority_server):
        assert_error(post(s, path, {**body, "priority": value}), 400, "priority", param="priority")


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_priority_policy_takes_any_priority_and_passes_it_on(priority_server, path, body):
    engine = priority_server.async_engine.engine
    seen: list[int] = []
    add = engine.add_request

    def spy(*args, **kw):
        seen.append(kw.get("priority", 0))
        return add(*args, **kw)

    engine.add_request = spy
    try:
        texts = [_text(post(priority_server, path, {**body, "priority": p})) for p in (0, 7, -2)]
        streamed = post(priority_server, path, {**body, "priority": 4, "stream": True})
    finally:
        del engine.add_request
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert seen == [0, 7, -2, 4]
    assert texts[1] == texts[0] == texts[2]  # greedy: the order changes, never the tokens
    assert priority_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_completions_with_several_prompts_give_each_the_priority(priority_server):
    engine = priority_server.async_engine.engine
    seen: list[int] = []
    add = engine.add_request
    engine.add_request = lambda *a, **kw: (seen.append(kw["priority"]), add(*a, **kw))[1]
    try:
        r = post(priority_server, "/v1/completions",
                 {**COMPLETION, "prompt": ["one two", "three four"], "priority": 9})
    finally:
        del engine.add_request
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert seen == [9, 9]


def _pooled(r) -> list[float]:
    """What a pooling endpoint answered, flat: the vectors one after another, or the
    scores in input order."""
    assert r.status_code == 200, r.text
    body = r.json()
    if "results" in body:  # rerank
        return [x["relevance_score"] for x in sorted(body["results"], key=lambda x: x["index"])]
    if "embedding" in body["data"][0]:
        return [v for d in body["data"] for v in d["embedding"]]
    return [d["score"] for d in body["data"]]


@pytest.mark.parametrize("path, body", POOLING)
def test_fcfs_takes_priority_zero_only_on_pooling_endpoints(server, path, body):
    assert _pooled(post(server, path, {**body, "priority": 0}))
    err = assert_error(post(server, path, {**body, "priority": 3}), 400,
                       "Got priority 3 but priority scheduling is not enabled",
                       "--scheduling-policy priority", param="priority")
    assert err["type"] == "invalid_request_error"
    assert_error(post(server, path, {**body, "priority": -1}), 400, "Got priority -1", param="priority")
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


@pytest.mark.parametrize("path, body", POOLING)
def test_pooling_endpoints_pass_the_priority_on(priority_server, path, body):
    """Every request a pooling call adds (one per distinct text) gets its priority; the
    vectors and scores are the same whatever it is."""
    engine = priority_server.async_engine.engine
    seen: list[int] = []
    add = engine.add_request
    engine.add_request = lambda *a, **kw: (seen.append(kw["priority"]), add(*a, **kw))[1]
    try:
        answers = [_pooled(post(priority_server, path, {**body, "priority": p})) for p in (0, 7, -2)]
        default = _pooled(post(priority_server, path, body))
    finally:
        del engine.add_request
    assert seen == [0] * 3 + [7] * 3 + [-2] * 3 + [0] * 3  # three distinct texts each time
    assert answers[1] == pytest.approx(answers[0], abs=1e-6)
    assert answers[2] == pytest.approx(answers[0], abs=1e-6) and default == pytest.approx(answers[0], abs=1e-6)
    assert priority_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
