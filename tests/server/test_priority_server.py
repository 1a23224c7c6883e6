"""The ``priority`` request field (vLLM's): an integer, reaching the engine with the priority
scheduling policy; under fcfs (the default) anything but 0 is a 400, as vLLM answers."""

from __future__ import annotations

import pytest

from tests.server.conftest import live_server
from tests.server.test_errors import assert_error, post

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
ENDPOINTS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


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


@pytest.mark.parametrize("path, body", ENDPOINTS)
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
