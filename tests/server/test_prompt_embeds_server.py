"""The completions endpoint's prompt_embeds (vLLM's): base64 of torch.save'd tensors, one or
a list, beside or instead of prompt; their completions are LLM.generate's; bad ones are a
400 naming the field, and leave no request or KV block behind."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.server.conftest import engine_kwargs, live_server

MAX_TOKENS = 8


def b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_server(tiny_model_dir):
    with live_server(tiny_model_dir, engine_kw={"enable_prompt_embeds": True}) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), **engine_kwargs(), enable_prompt_embeds=True)


def _embeds(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return llm.engine.model.model.embed_tokens(torch.tensor(ids)).clone()


def post(server, body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def _texts(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_completions_from_prompt_embeds_equal_generate(embeds_server, offline):
    g = torch.Generator().manual_seed(1)
    e1 = _embeds(offline, [1, 40, 41, 42, 43, 44, 45])
    e2 = torch.randn(11, offline.engine.model_config.hidden_size, generator=g) * 0.5
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = offline.generate([{"prompt_embeds": e1}, {"prompt_embeds": e2}, [1, 50, 51]], params,
                            use_tqdm=False)
    want_text = [o.outputs[0].text for o in want]
    base = {"model": embeds_server.model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    assert _texts(post(embeds_server, {**base, "prompt_embeds": b64(e1)})) == want_text[:1]
    r = post(embeds_server, {**base, "prompt_embeds": [b64(e1), b64(e2[None])]})  # [1, n, h] too
    assert _texts(r) == want_text[:2]
    assert r.json()["usage"]["prompt_tokens"] == 7 + 11
    # both fields: the embeds prompts first, then the prompts (vLLM's order)
    assert _texts(post(embeds_server, {**base, "prompt_embeds": [b64(e2)], "prompt": [[1, 50, 51]]})) \
        == want_text[1:]
    with httpx.stream("POST", embeds_server.url + "/v1/completions", timeout=60,
                      json={**base, "prompt_embeds": b64(e1), "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want_text[0]
    embeds_server.wait_idle()


def test_bad_prompt_embeds_are_400_naming_the_field(embeds_server):
    hidden = 64
    cases = [
        ("not base64 !!", "not valid base64"),
        (base64.b64encode(b"garbage bytes").decode(), "torch.save"),
        (b64({"a": torch.zeros(2, hidden)}), "not a tensor"),
        (b64(torch.zeros(3, hidden + 2)), f"hidden size {hidden + 2}"),
        (b64(torch.zeros(hidden)), "2-D"),
        (b64(torch.zeros(0, hidden)), "empty"),
        (b64(torch.zeros(3, hidden, dtype=torch.int32)), "floating-point"),
    ]
    for raw, needle in cases:
        for field in (raw, [b64(torch.zeros(2, hidden)), raw]):  # alone, or beside a good one
            r = post(embeds_server, {"prompt_embeds": field, "max_tokens": 2})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "prompt_embeds" and needle in err["message"], err
    r = post(embeds_server, {"prompt_embeds": b64(torch.zeros(2, hidden)), "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert post(embeds_server, {"max_tokens": 2}).status_code == 400  # neither field
    m = embeds_server.wait_idle()
    assert m["flashpage:kv_cache_blocks_used"] == 0 and m["flashpage:num_requests_running"] == 0


def test_refused_by_a_server_without_the_flag(server):
    r = post(server, {"prompt_embeds": b64(torch.zeros(3, 64)), "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_embeds" and "enable-prompt-embeds" in err["message"]
