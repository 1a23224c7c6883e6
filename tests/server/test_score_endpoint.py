"""POST /score and /rerank (vLLM's, for embedding models) and LLM.score: the cosine of two
texts' embeddings, as LLM.embed's vectors give it; documents ordered by it; bad input a 400
naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch

DOCS = ["the quick brown fox", "jumps over the lazy dog", "a quick brown fox", "yes no maybe"]


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60)


def _cos(offline_llm, a: str, b: str) -> float:
    va, vb = (torch.tensor(o.outputs.embedding) for o in offline_llm.embed([a, b], use_tqdm=False))
    return float(torch.dot(va, vb))


def test_score_one_against_many_and_pairwise(server, offline_llm):
    r = _post(server, "/v1/score", {"text_1": "the quick brown fox", "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    got = [d["score"] for d in body["data"]]
    want = [_cos(offline_llm, "the quick brown fox", d) for d in DOCS]
    assert got == pytest.approx(want, abs=1e-5)
    assert got[0] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    assert all(-1.0 - 1e-5 <= s <= 1.0 + 1e-5 for s in got)
    # distinct texts embedded once: the query and its copy in text_2 count once
    n = sum(len(offline_llm.get_tokenizer().encode(t)) for t in DOCS)
    assert body["usage"]["prompt_tokens"] == n
    offline = [o.outputs.score for o in offline_llm.score("the quick brown fox", DOCS, use_tqdm=False)]
    assert offline == pytest.approx(want, abs=1e-5)
    pair = _post(server, "/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert [d["score"] for d in pair["data"]] == pytest.approx(
        [_cos(offline_llm, DOCS[0], DOCS[2]), _cos(offline_llm, DOCS[1], DOCS[3])], abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score(server, offline_llm, path):
    r = _post(server, path, {"query": "a quick brown fox", "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = [_cos(offline_llm, "a quick brown fox", d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda j: -want[j])[:3]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx([want[j] for j in order], abs=1e-5)
    assert [x["document"]["text"] for x in results] == [DOCS[j] for j in order]
    bare = _post(server, path, {"query": "a quick brown fox", "documents": DOCS, "return_documents": False})
    assert len(bare.json()["results"]) == 4 and "document" not in bare.json()["results"][0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}, "text_1"),
    ("/v1/score", {"text_1": "", "text_2": DOCS}, "text_1"),
    ("/v1/score", {"text_1": "hi", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "hi", "text_2": [list(range(3, 200))]}, "text_2"),
    ("/v1/rerank", {"query": "hi", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": DOCS}, "query"),
    ("/v1/rerank", {"query": "hi", "documents": DOCS, "top_n": -1}, "top_n"),
])
def test_bad_score_requests(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or ""), r.json()
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_llm_score_bad_lengths(offline_llm):
    with pytest.raises(ValueError, match="text_1 has 2 items and text_2 3"):
        offline_llm.score(DOCS[:2], DOCS[:3], use_tqdm=False)
