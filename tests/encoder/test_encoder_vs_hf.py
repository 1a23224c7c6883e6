"""Encoder models (flashpage/encoder/) against transformers on tiny random checkpoints:
BERT / XLM-R embeddings pooled as sentence-transformers pools them (mean by default, the
folder's Pooling config else), cross-encoder scores as sigmoid of the head's logit over the
tokenizer's pair, in ragged batches split by the token budget (each prompt as if alone)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flashpage import LLM, PoolingParams
from tests.encoder_checkpoints import hf_model

TEXTS = ["the quick brown fox", "hello world", "paged cache keys values of every token in fixed size "
         "blocks", "a", "one two three four five six seven eight nine ten the lazy dog",
         "paris is the capital city of france"]
QUERY = "the capital of france"


def _llm(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 40, **kw}
    return LLM(str(path), **kw)


def _hf_hidden(path, tok, texts):
    model = hf_model(path)
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in texts]


@pytest.mark.parametrize("name,kind", [("bert", "mean"), ("xlmr", "mean"), ("bert_cls_pooling", "cls")])
def test_embeddings_equal_transformers_pooled(encoder_checkpoint, name, kind):
    path = encoder_checkpoint(name)
    llm = _llm(path)
    assert llm.engine.pooling_type == kind  # mean with no sentence-transformers files; cls from them
    hidden = _hf_hidden(path, llm.get_tokenizer(), TEXTS)
    want = [h.mean(0) if kind == "mean" else h[0] for h in hidden]
    outs = llm.embed(TEXTS, use_tqdm=False)
    # budget 40 over these lengths: several forwards, each padded to its longest prompt
    assert llm.engine.num_forwards > 1 and llm.engine.num_batched_tokens > sum(len(o.prompt_token_ids)
                                                                               for o in outs)
    for o, w in zip(outs, want, strict=True):
        assert o.error is None
        torch.testing.assert_close(torch.tensor(o.outputs.embedding),
                                   torch.nn.functional.normalize(w, dim=0), atol=1e-5, rtol=1e-5)
    raw = llm.embed(TEXTS[2], PoolingParams(dimensions=7, normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), want[2][:7], atol=1e-5, rtol=1e-5)
    # cosine scores for embedding models, as before
    s = llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)[0].outputs.score
    assert s == pytest.approx(float(torch.nn.functional.cosine_similarity(want[0], want[1], dim=0)),
                              abs=1e-5)


def test_pooling_type_override_and_one_prompt_per_forward(encoder_checkpoint):
    path = encoder_checkpoint("bert")
    llm = _llm(path, pooling_type="last", max_num_seqs=1)
    hidden = _hf_hidden(path, llm.get_tokenizer(), TEXTS[:3])
    outs = llm.embed(TEXTS[:3], use_tqdm=False)
    assert llm.engine.num_forwards == 3  # one seat: no padding
    for o, h in zip(outs, hidden, strict=True):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding),
                                   torch.nn.functional.normalize(h[-1], dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["bert_reranker", "xlmr_reranker"])
def test_cross_encoder_scores_equal_sigmoid_of_transformers(encoder_checkpoint, name):
    path = encoder_checkpoint(name)
    llm = _llm(path)
    tok, model = llm.get_tokenizer(), hf_model(path)
    with torch.no_grad():
        want = [torch.sigmoid(model(**tok(QUERY, t, return_tensors="pt")).logits[0, 0]).item()
                for t in TEXTS]
    got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(g, 3) for g in got)) > 3  # the pairs are told apart
    # pairwise, and as token ids (joined with the tokenizer's specials: the same inputs)
    pairwise = llm.score([QUERY] * 2, TEXTS[:2], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(want[:2], abs=1e-5)
    ids = [tok.encode(t, add_special_tokens=False) for t in (QUERY, TEXTS[2])]
    assert llm.score(ids[0], [ids[1]], use_tqdm=False)[0].outputs.score == pytest.approx(want[2], abs=1e-5)
    assert llm.engine.encode_pair(ids[0], ids[1]) == tok(QUERY, TEXTS[2])["input_ids"]


def test_identity_activation_from_sentence_transformers(encoder_checkpoint, tmp_path):
    """A checkpoint whose sentence-transformers config names Identity scores with the raw
    logit (sbert_ce_default_activation_function, as ms-marco-MiniLM's)."""
    src = encoder_checkpoint("bert_reranker")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["sbert_ce_default_activation_function"] = "torch.nn.modules.linear.Identity"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = _llm(tmp_path)
    tok, model = llm.get_tokenizer(), hf_model(tmp_path)
    with torch.no_grad():
        want = model(**tok(QUERY, TEXTS[0], return_tensors="pt")).logits[0, 0].item()
    assert llm.score(QUERY, TEXTS[0], use_tqdm=False)[0].outputs.score == pytest.approx(want, abs=1e-5)


def test_pytorch_bin_with_old_layernorm_names(encoder_checkpoint, tmp_path):
    """pytorch_model.bin with the "bert." prefix and LayerNorm gamma/beta loads as the
    safetensors file does."""
    from safetensors.torch import load_file

    src = encoder_checkpoint("bert")
    state = load_file(str(src / "model.safetensors"))
    renamed = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in state.items()}
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    torch.save(renamed, tmp_path / "pytorch_model.bin")
    a = _llm(src).embed(TEXTS[:2], use_tqdm=False)
    b = _llm(tmp_path).embed(TEXTS[:2], use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs.embedding == y.outputs.embedding
    # a missing weight is named
    del renamed["bert.encoder.layer.1.output.dense.weight"]
    torch.save(renamed, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="encoder.layer.1.output.dense.weight"):
        _llm(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bits_on_the_gpu(encoder_checkpoint, dtype):
    """CUDA in 16 bits (SDPA's flash kernel for a batch without padding, the efficient one
    with a mask): close to transformers' fp32 on the CPU."""
    path = encoder_checkpoint("xlmr")
    llm = _llm(path, dtype=dtype, device="cuda")
    hidden = _hf_hidden(path, llm.get_tokenizer(), TEXTS)
    outs = llm.embed(TEXTS, use_tqdm=False) + llm.embed(TEXTS[:1], use_tqdm=False)
    for o, h in zip(outs, hidden + hidden[:1], strict=True):
        cos = torch.nn.functional.cosine_similarity(torch.tensor(o.outputs.embedding), h.mean(0), dim=0)
        assert cos > 0.995, (dtype, float(cos))
    path = encoder_checkpoint("bert_reranker")
    llm = _llm(path, dtype=dtype, device="cuda")
    tok, model = llm.get_tokenizer(), hf_model(path)
    with torch.no_grad():
        want = [torch.sigmoid(model(**tok(QUERY, t, return_tensors="pt")).logits[0, 0]).item()
                for t in TEXTS]
    got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    assert got == pytest.approx(want, abs=3e-2)
