"""Sequence classification (vLLM's LLM.classify and /classify) on an encoder classifier:
class probabilities equal the softmax of transformers' logits; labels from id2label; what
is not a classifier refuses it."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from flashpage import LLM
from tests.encoder_checkpoints import hf_model
from tests.server.conftest import live_server

TEXTS = ["the quick brown fox", "hello world", "money in the bank by the river", "paris"]


def _llm(path) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def labelled(encoder_checkpoint, tmp_path_factory):
    """bert_two_labels with names for its classes."""
    path = tmp_path_factory.mktemp("two_labels_named")
    for f in encoder_checkpoint("bert_two_labels").iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["id2label"], cfg["label2id"] = {"0": "neg", "1": "pos"}, {"neg": 0, "pos": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_probabilities_equal_transformers(labelled):
    llm = _llm(labelled)
    tok, model = llm.get_tokenizer(), hf_model(labelled)
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits[0].softmax(-1).tolist() for t in TEXTS]
    outs = llm.classify(TEXTS, use_tqdm=False)
    for o, w in zip(outs, want, strict=True):
        assert o.error is None and o.outputs.num_classes == 2
        assert o.outputs.probs == pytest.approx(w, abs=1e-5)
    assert llm.engine.model_config.labels == ("neg", "pos")
    assert len({round(o.outputs.probs[0], 4) for o in outs}) > 2  # the texts are told apart


def test_what_is_not_a_classifier_refuses(encoder_checkpoint, tiny_checkpoint):
    with pytest.raises(ValueError, match="no classification head"):
        _llm(encoder_checkpoint("bert")).classify(TEXTS)
    decoder = LLM(str(tiny_checkpoint("llama2_mha")), device="cpu", dtype="float32", num_gpu_blocks=16)
    with pytest.raises(ValueError, match="not a sequence classifier"):
        decoder.classify([[5, 6, 7]])


def test_the_classify_endpoint(labelled, encoder_checkpoint):
    offline = _llm(labelled).classify(TEXTS, use_tqdm=False)
    with live_server(labelled, engine_kw={"max_model_len": None, "max_num_batched_tokens": 48}) as s:
        r = httpx.post(s.url + "/classify", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        for d, o in zip(body["data"], offline, strict=True):
            assert d["probs"] == pytest.approx(o.outputs.probs, abs=1e-6) and d["num_classes"] == 2
            assert d["label"] == ("neg", "pos")[int(o.outputs.probs[1] > o.outputs.probs[0])]
        assert body["usage"]["prompt_tokens"] > 0
    with live_server(encoder_checkpoint("bert"), engine_kw={"max_model_len": None}) as s:
        r = httpx.post(s.url + "/classify", json={"input": "hello"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
