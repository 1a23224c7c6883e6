"""A client that goes away mid-request aborts it: its KV blocks are freed at once."""

from __future__ import annotations

import json
import time

import httpx
import pytest

ABORT = 'flashpage:request_finished_total{finish_reason="abort"}'


def wait_aborted(server, before: float, expected: int, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.wait_idle(timeout)
        if m.get(ABORT, 0.0) - before >= expected or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_disconnect_frees_blocks(server, endpoint):
    before = server.metrics().get(ABORT, 0.0)
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": "the quick brown fox"}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    body.update(model=server.model, max_tokens=100, n=4, temperature=1.0, seed=3,
                ignore_eos=True, stream=True)
    events = []
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break  # leave with the request half done; closing drops the connection
    assert all(c["choices"][0]["finish_reason"] is None for c in events)
    m = wait_aborted(server, before, 4)
    assert m["flashpage:kv_cache_blocks_used"] == 0
    assert m["flashpage:num_requests_running"] == 0
    # All four choices were cut short (none ran to max_tokens).
    assert m.get(ABORT, 0.0) - before == 4


def test_non_streamed_disconnect_frees_blocks(server, monkeypatch):
    # Each engine step made to take 10 ms, so the 110 steps outlast the 0.3 s read timeout on
    # any machine (a fast CPU finished all sixteen choices inside it).
    engine = server.async_engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    before = server.metrics().get(ABORT, 0.0)
    body = dict(model=server.model, prompt="hello world", max_tokens=110, n=16,
                temperature=1.0, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    m = wait_aborted(server, before, 16)
    assert m["flashpage:kv_cache_blocks_used"] == 0
    assert m.get(ABORT, 0.0) - before == 16


def test_server_still_serves_after_disconnects(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30, json=dict(
        model=server.model, prompt="one two", max_tokens=5, temperature=0, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
