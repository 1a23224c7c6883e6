"""The server on encoder models (flashpage/encoder/): /v1/embeddings on a BERT embedding
model (floats, and base64 of their very float32 bytes) and /score, /rerank on a
cross-encoder equal the offline LLM's (ModernBERT's too: an embedding model and a
cross-encoder; and NomicBERT's embeddings); generation, embedding
a cross-encoder and over-long items are 400s naming the field, and cost nobody else."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.encoder_checkpoints import MAX_POSITIONS, build_encoder_checkpoint
from tests.server.conftest import live_server

DOCS = ["the quick brown fox", "paris is the capital city of france", "hello world",
        "money in the bank by the river"]
QUERY = "the capital of france"
ENGINE = {"max_model_len": None, "max_num_batched_tokens": 48}  # the encoder's own positions


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60)


def _offline(path):
    from flashpage import LLM

    return LLM(str(path), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_encoder_checkpoint(tmp_path_factory.mktemp("srv_bert"), "bert")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return build_encoder_checkpoint(tmp_path_factory.mktemp("srv_xlmr_reranker"), "xlmr_reranker")


def test_embeddings_and_cosine_scores(bert_dir):
    llm = _offline(bert_dir)
    want = [o.outputs.embedding for o in llm.embed(DOCS, use_tqdm=False)]
    with live_server(bert_dir, engine_kw=ENGINE) as srv:
        r = _post(srv, "/v1/embeddings", {"input": DOCS})
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in r.json()["data"]]
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, abs=1e-5)
        # base64: the bytes of the very float32 values the float answer lists (one input a
        # request: a batch of its own both times, so the same vector to the bit)
        floats, b64 = (_post(srv, "/v1/embeddings", {"input": DOCS[1], "encoding_format": f}).json()
                       for f in ("float", "base64"))
        assert base64.b64decode(b64["data"][0]["embedding"]) == \
            np.asarray(floats["data"][0]["embedding"], dtype="<f4").tobytes()
        r = _post(srv, "/v1/embeddings", {"input": DOCS, "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        for d, g in zip(r.json()["data"], got, strict=True):
            assert np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() == pytest.approx(g, abs=1e-6)
        r = _post(srv, "/score", {"text_1": DOCS[0], "text_2": DOCS[1:]})
        assert r.status_code == 200, r.text
        cos = [o.outputs.score for o in llm.score(DOCS[0], DOCS[1:], use_tqdm=False)]
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(cos, abs=1e-5)
        # an over-long input is a 400 naming it; one that fits exactly runs
        long_text = " ".join(["the"] * MAX_POSITIONS)  # 66 tokens with [CLS] and [SEP]
        r = _post(srv, "/v1/embeddings", {"input": [DOCS[0], long_text]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "take up to 64" in r.json()["error"]["message"]
        r = _post(srv, "/v1/embeddings", {"input": [long_text], "truncate_prompt_tokens": MAX_POSITIONS})
        assert r.status_code == 200, r.text
        ids = llm.get_tokenizer().encode(long_text)
        cut = ids[: MAX_POSITIONS - 1] + ids[-1:]  # [CLS] kept, [SEP] kept
        assert r.json()["data"][0]["embedding"] == pytest.approx(
            llm.embed([cut], use_tqdm=False)[0].outputs.embedding, abs=1e-5)
        r = _post(srv, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 400 and "does not support generation" in r.json()["error"]["message"]
        r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "does not support generation" in r.json()["error"]["message"]
        srv.wait_idle()


def test_cross_encoder_score_and_rerank(reranker_dir):
    llm = _offline(reranker_dir)
    want = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    with live_server(reranker_dir, engine_kw=ENGINE) as srv:
        r = _post(srv, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        pair_tokens = sum(len(llm.engine.encode_pair(QUERY, d)) for d in DOCS)
        assert body["usage"]["prompt_tokens"] == pair_tokens
        r = _post(srv, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True})
        assert r.status_code == 200, r.text
        order = sorted(range(len(DOCS)), key=lambda j: -want[j])[:2]
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx([want[j] for j in order], abs=1e-5)
        assert results[0]["document"] == {"text": DOCS[order[0]]}
        # pairwise with token ids: joined with <s> .. </s></s> .. </s> as the texts are
        tok = llm.get_tokenizer()
        ids = [tok.encode(t, add_special_tokens=False) for t in (QUERY, DOCS[1])]
        r = _post(srv, "/score", {"text_1": [ids[0]], "text_2": [ids[1]]})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["score"] == pytest.approx(want[1], abs=1e-5)
        # bad requests: 400s naming the field, and the engine left with nothing queued
        long_doc = " ".join(["the"] * MAX_POSITIONS)
        r = _post(srv, "/rerank", {"query": QUERY, "documents": [DOCS[0], long_doc]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
        r = _post(srv, "/score", {"text_1": "", "text_2": DOCS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_1", r.text
        r = _post(srv, "/v1/embeddings", {"input": DOCS})
        assert r.status_code == 400 and "it scores pairs" in r.json()["error"]["message"]
        r = _post(srv, "/rerank", {"query": QUERY, "documents": [long_doc], "truncate_prompt_tokens": 20})
        assert r.status_code == 200, r.text
        cut = llm.engine.truncate_prompt(llm.engine.encode_pair(QUERY, long_doc), 20)
        assert len(cut) == 20 and cut[0] == 0 and cut[-1] == 2
        assert llm.engine.get_num_unfinished_requests() == 0
        assert srv.wait_idle()["flashpage:num_requests_waiting"] == 0


def test_modernbert_embeddings_and_rerank(tmp_path_factory):
    """ModernBERT through the server as BERT: /v1/embeddings (prompts longer than its local
    window among them) and /rerank on its cross-encoder equal the offline LLM's."""
    docs = DOCS + ["one two three four five six seven eight nine ten the lazy dog"]
    emb_dir = build_encoder_checkpoint(tmp_path_factory.mktemp("srv_modernbert"), "modernbert")
    want = [o.outputs.embedding for o in _offline(emb_dir).embed(docs, use_tqdm=False)]
    with live_server(emb_dir, engine_kw=ENGINE) as srv:
        r = _post(srv, "/v1/embeddings", {"input": docs})
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want, strict=True):
            assert d["embedding"] == pytest.approx(w, abs=1e-5)
    rerank_dir = build_encoder_checkpoint(tmp_path_factory.mktemp("srv_modernbert_reranker"),
                                          "modernbert_reranker")
    scores = [o.outputs.score for o in _offline(rerank_dir).score(QUERY, docs, use_tqdm=False)]
    with live_server(rerank_dir, engine_kw=ENGINE) as srv:
        r = _post(srv, "/rerank", {"query": QUERY, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda j: -scores[j])
        assert [x["relevance_score"] for x in results] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)
        r = _post(srv, "/v1/embeddings", {"input": docs})
        assert r.status_code == 400 and "it scores pairs" in r.json()["error"]["message"]


def test_nomic_bert_embeddings(tmp_path_factory):
    """NomicBERT's /v1/embeddings equal the offline LLM's, `dimensions` (Matryoshka, as
    nomic-embed-text-v1.5 is used) included."""
    path = build_encoder_checkpoint(tmp_path_factory.mktemp("srv_nomic"), "nomic")
    llm = _offline(path)
    want = [o.outputs.embedding for o in llm.embed(DOCS, use_tqdm=False)]
    with live_server(path, engine_kw=ENGINE) as srv:
        r = _post(srv, "/v1/embeddings", {"input": DOCS})
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want, strict=True):
            assert d["embedding"] == pytest.approx(w, abs=1e-5)
        r = _post(srv, "/v1/embeddings", {"input": DOCS[:2], "dimensions": 16})
        assert r.status_code == 200, r.text
        short = np.asarray(want[0][:16])
        assert r.json()["data"][0]["embedding"] == pytest.approx((short / np.linalg.norm(short)).tolist(), abs=1e-5)
