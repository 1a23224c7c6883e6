"""LoRA adapters over HTTP (vLLM's --enable-lora --lora-modules name=path): a request's
"model" picks the adapter, /v1/models lists the adapters under the served model, an
unknown name is a 404, and each answer is the merged checkpoint's (tests/peft_adapter.py)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from flashpage import LLM, LoRARequest, SamplingParams
from flashpage.cli import parse_lora_modules
from tests.peft_adapter import merge_adapter, write_adapter
from tests.server.conftest import engine_kwargs, live_server

PROMPTS = ["the quick brown fox", "hello world, how are", "one two three four"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    a = write_adapter(root / "sql", tiny_model_dir, r=8, alpha=16, seed=1)
    b = write_adapter(root / "chat", tiny_model_dir, r=4, alpha=8, seed=2,
                      targets=("q_proj", "v_proj", "down_proj"))
    return {"sql": (a, merge_adapter(tiny_model_dir, a, root / "merged_sql")),
            "chat": (b, merge_adapter(tiny_model_dir, b, root / "merged_chat"))}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters):
    loras = [LoRARequest(n, i + 1, str(a)) for i, (n, (a, _)) in enumerate(adapters.items())]
    with live_server(tiny_model_dir, engine_kw=dict(enable_lora=True, max_loras=2, max_lora_rank=8),
                     lora_modules=loras) as s:
        yield s


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """Offline greedy texts of PROMPTS on the base and on each merged checkpoint."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = {}
    for name, path in [("tiny", tiny_model_dir), *((n, m) for n, (_, m) in adapters.items())]:
        llm = LLM(str(path), **engine_kwargs())
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert out["sql"] != out["tiny"] and out["chat"] != out["tiny"]  # the adapters change things
    return out


def _complete(server, model: str, prompt: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
            "ignore_eos": True, **kw}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_models_lists_the_adapters(lora_server, adapters):
    data = httpx.get(lora_server.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == ["tiny", "sql", "chat"]
    assert data[0]["parent"] is None
    for m in data[1:]:
        assert m["parent"] == "tiny" and m["root"] == str(adapters[m["id"]][0])


def test_model_name_selects_the_adapter(lora_server, expected):
    for model in ("tiny", "sql", "chat"):
        for i, prompt in enumerate(PROMPTS):
            r = _complete(lora_server, model, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            assert r.json()["choices"][0]["text"] == expected[model][i], (model, prompt)
    lora_server.wait_idle()


def test_concurrent_mixed_adapters(lora_server, expected):
    jobs = [(m, i) for m in ("sql", "tiny", "chat") for i in range(len(PROMPTS))] * 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: _complete(lora_server, j[0], PROMPTS[j[1]]), jobs))
    for (model, i), r in zip(jobs, results, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[model][i]
    m = lora_server.wait_idle()
    assert m["flashpage:kv_cache_blocks_used"] == 0


def test_streamed_chat_with_an_adapter(lora_server):
    msgs = [{"role": "user", "content": "hello world"}]
    body = {"model": "sql", "messages": msgs, "max_tokens": 8, "temperature": 0.0}
    whole = httpx.post(lora_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    base = httpx.post(lora_server.url + "/v1/chat/completions", json={**body, "model": "tiny"},
                      timeout=60).json()
    assert whole["model"] == "sql"
    assert whole["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    text, models = "", set()
    with httpx.stream("POST", lora_server.url + "/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                models.add(chunk["model"])
                for c in chunk["choices"]:
                    text += c["delta"].get("content") or ""
    assert text == whole["choices"][0]["message"]["content"] and models == {"sql"}


def test_unknown_model_is_404(lora_server):
    r = _complete(lora_server, "nope", "hi")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`nope`" in err["message"] and "`sql`" in err["message"]


def test_bad_lora_modules_stop_the_start(tiny_model_dir, adapters, tmp_path):
    from flashpage.server.api_server import build_app
    from flashpage.server.async_engine import AsyncEngine

    plain = LLM(str(tiny_model_dir), **engine_kwargs())
    ok = LoRARequest("sql", 1, str(adapters["sql"][0]))
    with pytest.raises(ValueError, match="enable_lora"):
        build_app(AsyncEngine(plain.engine), "tiny", lora_modules=[ok])
    lora = LLM(str(tiny_model_dir), enable_lora=True, max_lora_rank=8, **engine_kwargs())
    with pytest.raises(ValueError, match="does not exist"):
        build_app(AsyncEngine(lora.engine), "tiny",
                  lora_modules=[LoRARequest("x", 1, str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match="name of its own"):
        build_app(AsyncEngine(lora.engine), "tiny", lora_modules=[LoRARequest("tiny", 1, ok.lora_path)])


def test_parse_lora_modules():
    got = parse_lora_modules(["a=/x/y", '{"name": "b", "path": "/z", "base_model_name": "m"}'])
    assert got == [LoRARequest("a", 1, "/x/y"), LoRARequest("b", 2, "/z")]
    for bad in ("a", "=/x", "a=", '{"name": "b"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_serve_refuses_lora_modules_without_enable_lora(capsys):
    from flashpage.cli import main

    assert main(["serve", "--lora-modules", "a=/x"]) == 2  # before any model loads
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err


def test_embeddings_under_an_adapter(lora_server, adapters):
    """/v1/embeddings with an adapter's name: the merged checkpoint's pooled hidden states."""
    import torch

    r = httpx.post(lora_server.url + "/v1/embeddings", json={"model": "chat", "input": PROMPTS},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "chat"
    got = torch.tensor([d["embedding"] for d in r.json()["data"]])
    merged = LLM(str(adapters["chat"][1]), **engine_kwargs()).embed(PROMPTS, use_tqdm=False)
    torch.testing.assert_close(got, torch.tensor([o.outputs.embedding for o in merged]),
                               atol=1e-5, rtol=1e-4)
    base = httpx.post(lora_server.url + "/v1/embeddings", json={"model": "tiny", "input": PROMPTS},
                      timeout=60).json()["data"]
    assert (got - torch.tensor([d["embedding"] for d in base])).abs().max() > 1e-2
    # /score and /rerank under the adapter: the cosines of its embeddings
    want = [float(got[0] @ got[j]) for j in range(len(PROMPTS))]
    for path, body, key in (("/score", {"text_1": PROMPTS[0], "text_2": PROMPTS}, "data"),
                            ("/rerank", {"query": PROMPTS[0], "documents": PROMPTS}, "results")):
        r = httpx.post(lora_server.url + path, json={"model": "chat", **body}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "chat"
        got_scores = {d["index"]: d.get("score", d.get("relevance_score")) for d in r.json()[key]}
        assert [got_scores[j] for j in range(len(PROMPTS))] == pytest.approx(want, abs=1e-4)
