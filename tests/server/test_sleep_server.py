"""vLLM's sleep-mode routes (FLASHPAGE_SERVER_DEV_MODE=1): POST /sleep?level=N, POST
/wake_up (tags repeated), GET /is_sleeping, and our POST /reload_weights. A completion while
asleep is a 503 naming the wake_up; after waking it answers as before; sleeping with a
request in flight is a 409; without dev mode the paths do not exist."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import live_server
from tests.server.test_errors import assert_error, post

BODY = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def sleepy_server(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHPAGE_SERVER_DEV_MODE", "1")
        with live_server(tiny_model_dir, engine_kw=dict(enable_sleep_mode=True)) as s:
            yield s


def _asleep(s) -> bool:
    r = s.get("/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def _text(s) -> str:
    r = post(s, "/v1/completions", BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_sleep_wake_round_trip(sleepy_server):
    s = sleepy_server
    want = _text(s)
    assert want and not _asleep(s)
    r = post(s, "/sleep?level=1")
    assert r.status_code == 200 and r.content == b""
    assert _asleep(s)
    assert_error(post(s, "/v1/completions", BODY), 503, "asleep", "wake_up()")
    assert post(s, "/wake_up?tags=weights").status_code == 200
    assert _asleep(s)  # the KV cache still sleeps
    assert_error(post(s, "/v1/completions", BODY), 503, "wake_up(tags=['kv_cache'])")
    assert post(s, "/wake_up?tags=kv_cache").status_code == 200
    assert not _asleep(s)
    assert _text(s) == want
    # level 2: the weights come back from the checkpoint
    assert post(s, "/sleep?level=2").status_code == 200
    assert post(s, "/wake_up?tags=weights&tags=kv_cache").status_code == 200
    assert not _asleep(s)
    assert_error(post(s, "/v1/completions", BODY), 503, "reload_weights")
    assert post(s, "/reload_weights").status_code == 200
    assert _text(s) == want
    assert s.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_bad_arguments(sleepy_server):
    s = sleepy_server
    assert_error(post(s, "/sleep?level=3"), 400, "sleep level must be 1")
    assert_error(post(s, "/sleep?level=x"), 400, "level must be 1 or 2")
    assert_error(post(s, "/wake_up?tags=weight"), 400, "unknown wake_up tag")
    assert post(s, "/sleep").status_code == 200  # level 1 by default, as vLLM's
    assert_error(post(s, "/reload_weights"), 400, "wake_up(tags=['weights'])")
    assert post(s, "/wake_up").status_code == 200
    assert not _asleep(s)


def test_sleep_with_a_request_in_flight(sleepy_server, monkeypatch):
    s = sleepy_server
    engine = s.async_engine.engine
    real_step = engine.step

    def slow_step(*args, **kw):  # 100 tokens take seconds: the request is still running
        time.sleep(0.03)
        return real_step(*args, **kw)

    monkeypatch.setattr(engine, "step", slow_step)
    body = {**BODY, "max_tokens": 100, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", s.url + "/v1/completions",
                                                           json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (kept: a dropped iterator closes the stream, aborting it)
        next(lines)  # the request runs
        assert_error(post(s, "/sleep?level=1"), 409, "still in flight")
        assert_error(post(s, "/reload_weights"), 409, "still in flight")
    monkeypatch.undo()
    s.wait_idle()
    assert not _asleep(s)
    assert post(s, "/sleep?level=1").status_code == 200
    assert post(s, "/wake_up").status_code == 200


def test_routes_need_dev_mode_and_sleep_mode(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("FLASHPAGE_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with live_server(tiny_model_dir, engine_kw=dict(enable_sleep_mode=True)) as s:
        for path in ("/sleep", "/wake_up", "/reload_weights"):
            assert post(s, path).status_code == 404
        assert s.get("/is_sleeping").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's name works too
    with live_server(tiny_model_dir) as s:
        assert_error(post(s, "/sleep?level=1"), 400, "sleep mode is off", "--enable-sleep-mode")
        assert not _asleep(s)
