"""POST /v1/embeddings: LLM.embed's vectors for text and token-id inputs (floats and base64,
OpenAI's client too), dimensions cut and renormalized, usage counted; bad inputs a 400
naming the field; embeddings beside streamed chats."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch

from flashpage import PoolingParams


def _post(server, body):
    return httpx.post(server.url + "/v1/embeddings", json={"model": server.model, **body}, timeout=60)


def test_embeddings_equal_offline(server, offline_llm):
    texts = ["the quick brown fox", "jumps over", "a lazy dog"]
    r = _post(server, {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    ref = offline_llm.embed(texts, use_tqdm=False)
    for d, o in zip(body["data"], ref, strict=True):
        assert d["object"] == "embedding"
        torch.testing.assert_close(torch.tensor(d["embedding"]), torch.tensor(o.outputs.embedding),
                                   atol=1e-5, rtol=1e-4)
    n = sum(len(o.prompt_token_ids) for o in ref)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    ids = ref[0].prompt_token_ids
    one = _post(server, {"input": ids, "encoding_format": "base64", "dimensions": 8}).json()["data"]
    assert len(one) == 1
    vec = struct.unpack("<8f", base64.b64decode(one[0]["embedding"]))
    want = offline_llm.embed([ids], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(vec), torch.tensor(want), atol=1e-5, rtol=1e-4)
    assert abs(torch.tensor(vec).norm().item() - 1.0) < 1e-5


def test_openai_client_embeddings(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    r = client.embeddings.create(model=server.model, input=["hello", "world"])  # base64 by default
    assert len(r.data) == 2 and len(r.data[0].embedding) == server.async_engine.hidden_size


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[]]}, "input"),
    ({"input": "hi", "dimensions": 100_000}, "dimensions"), ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": [1, 2, 10_000]}, "input"), ({"input": list(range(3, 200))}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_embedding_requests(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or ""), r.json()


def test_embedding_input_fills_max_model_len(server, offline_llm):
    """Up to max_model_len tokens (vLLM's rule: the ignored token takes no KV slot); one
    more is a 400 naming the limit."""
    from tests.server.conftest import MAX_MODEL_LEN

    ids = [(7 * i) % 200 + 3 for i in range(MAX_MODEL_LEN)]
    r = _post(server, {"input": ids})
    assert r.status_code == 200, r.text
    want = offline_llm.embed([ids], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), torch.tensor(want),
                               atol=1e-5, rtol=1e-4)
    r = _post(server, {"input": ids + [5]})
    assert r.status_code == 400 and f"take up to {MAX_MODEL_LEN}" in r.json()["error"]["message"]
