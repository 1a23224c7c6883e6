"""ModernBERT (flashpage/encoder/modernbert.py) against transformers on tiny random
checkpoints of three layers (global, local, global) whose window (8: keys within 4
positions) is shorter than most prompts here: embeddings pooled and normalized, a
cross-encoder's scores, a mean-pooling classifier's probabilities, in ragged batches split
by the token budget, each prompt as if alone; the per-token work sees only real tokens
(unpadded); the Hub's config form and transformers 5's read alike; unsupported fields are
ConfigErrors naming them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flashpage import LLM
from flashpage.config import ConfigError
from flashpage.encoder.config import EncoderConfig
from tests.encoder_checkpoints import MODERNBERT_WINDOW, hf_model

TEXTS = ["the quick brown fox", "hello world", "paged cache keys values of every token in fixed size "
         "blocks", "a", "one two three four five six seven eight nine ten the lazy dog",
         "paris is the capital city of france", "money in the bank by the river water"]
QUERY = "the capital of france"


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 40, **kw})


def _copy(src, dst, **changes):
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _hf_mean(path, tok, texts):
    model = hf_model(path)
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0) for t in texts]


@pytest.mark.parametrize("name", ["modernbert", "modernbert_biased"])
def test_embeddings_equal_transformers(encoder_checkpoint, name):
    path = encoder_checkpoint(name)
    llm = _llm(path)
    tok = llm.get_tokenizer()
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    assert max(lengths) > 3 * MODERNBERT_WINDOW // 2 and min(lengths) <= MODERNBERT_WINDOW // 2 + 1
    want = _hf_mean(path, tok, TEXTS)
    outs = llm.embed(TEXTS, use_tqdm=False)
    eng = llm.engine
    assert eng.model_config.family == "modernbert" and eng.num_forwards > 1
    assert eng.num_batched_tokens > sum(lengths)  # some batches were padded
    for o, w in zip(outs, want, strict=True):
        assert o.error is None
        torch.testing.assert_close(torch.tensor(o.outputs.embedding),
                                   torch.nn.functional.normalize(w, dim=0), atol=1e-5, rtol=1e-5)
    # each prompt alone (no padding at all) gives the same vectors
    for t, o in zip(TEXTS, outs, strict=True):
        alone = llm.embed([t], use_tqdm=False)[0].outputs.embedding
        assert alone == pytest.approx(o.outputs.embedding, abs=1e-5)
    # cosine scores, as for any embedding model
    s = llm.score(TEXTS[0], TEXTS[5], use_tqdm=False)[0].outputs.score
    assert s == pytest.approx(float(torch.nn.functional.cosine_similarity(want[0], want[5], dim=0)),
                              abs=1e-5)


def test_the_window_and_the_hub_config_form(encoder_checkpoint, tmp_path):
    """A wider window changes exactly the prompts longer than the narrow one; the Hub's
    config form (global_attn_every_n_layers, global / local_rope_theta, no layer_types nor
    rope_parameters) reads as transformers 5's."""
    path = encoder_checkpoint("modernbert")
    base = [o.outputs.embedding for o in _llm(path).embed(TEXTS, use_tqdm=False)]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    rope = cfg["rope_parameters"]
    hub = _copy(path, tmp_path / "hub", layer_types=None, rope_parameters=None,
                global_rope_theta=rope["full_attention"]["rope_theta"],
                local_rope_theta=rope["sliding_attention"]["rope_theta"])
    assert EncoderConfig.from_hf(str(hub)) == EncoderConfig.from_hf(str(path))
    assert [o.outputs.embedding for o in _llm(hub).embed(TEXTS, use_tqdm=False)] == base
    wide = _copy(path, tmp_path / "wide", local_attention=4 * MODERNBERT_WINDOW)
    want = _hf_mean(wide, _llm(wide).get_tokenizer(), TEXTS)
    tok = _llm(path).get_tokenizer()
    for t, b, w, o in zip(TEXTS, base, want, _llm(wide).embed(TEXTS, use_tqdm=False), strict=True):
        got = torch.tensor(o.outputs.embedding)
        torch.testing.assert_close(got, torch.nn.functional.normalize(w, dim=0), atol=1e-5, rtol=1e-5)
        if len(tok(t)["input_ids"]) - 1 <= MODERNBERT_WINDOW // 2:  # every pair within the window
            assert (got - torch.tensor(b)).abs().max() < 1e-5
        else:
            assert (got - torch.tensor(b)).abs().max() > 1e-3


def test_unpadded_per_token_work(encoder_checkpoint, monkeypatch):
    """A ragged batch's linear layers see its real tokens only; attention's padded view
    never leaks into them."""
    llm = _llm(encoder_checkpoint("modernbert"), max_num_batched_tokens=4096)
    rows: list[int] = []
    wi = llm.engine.model.layers[1].mlp.Wi
    wi.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    tok = llm.get_tokenizer()
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert llm.engine.num_forwards == 1 and rows == [sum(len(tok(t)["input_ids"]) for t in TEXTS)]
    assert all(o.error is None for o in outs)


def test_long_local_layers_in_blocks(encoder_checkpoint, monkeypatch):
    """Past 2 x (block + window) tokens a local layer runs its queries in blocks against the
    keys their window reaches (layers.Ragged): still transformers' embeddings and scores."""
    from flashpage.encoder import layers

    monkeypatch.setattr(layers, "LOCAL_BLOCK_MIN", 2)  # blocks of 8 (the window): from 32 tokens
    words = " ".join(TEXTS).split()
    long_texts = [" ".join(words[:40]), " ".join(words[5:38]), " ".join(words[3:50])]
    calls: list[int] = []
    real = layers.Ragged._blocked

    def spy(self, q, k, v):
        calls.append(q.shape[2])
        return real(self, q, k, v)

    monkeypatch.setattr(layers.Ragged, "_blocked", spy)
    path = encoder_checkpoint("modernbert_biased")
    llm = _llm(path, max_num_batched_tokens=256)
    want = _hf_mean(path, llm.get_tokenizer(), long_texts + TEXTS[:2])
    outs = llm.embed(long_texts + TEXTS[:2], use_tqdm=False)
    assert calls and max(calls) >= 32
    for o, w in zip(outs, want, strict=True):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding),
                                   torch.nn.functional.normalize(w, dim=0), atol=1e-5, rtol=1e-5)
    path = encoder_checkpoint("modernbert_reranker")
    llm = _llm(path, max_num_batched_tokens=256)
    tok, model = llm.get_tokenizer(), hf_model(path)
    with torch.no_grad():
        scores = [torch.sigmoid(model(**tok(QUERY, t, return_tensors="pt")).logits[0, 0]).item()
                  for t in long_texts]
    assert [o.outputs.score for o in llm.score(QUERY, long_texts, use_tqdm=False)] == pytest.approx(scores, abs=1e-5)


def test_cross_encoder_scores_equal_sigmoid_of_transformers(encoder_checkpoint):
    path = encoder_checkpoint("modernbert_reranker")
    llm = _llm(path)
    tok, model = llm.get_tokenizer(), hf_model(path)
    assert "token_type_ids" not in tok(QUERY, TEXTS[0])  # ModernBERT has no token types
    with torch.no_grad():
        want = [torch.sigmoid(model(**tok(QUERY, t, return_tensors="pt")).logits[0, 0]).item()
                for t in TEXTS]
    got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(g, 3) for g in got}) > 3  # the pairs are told apart
    ids = [tok.encode(t, add_special_tokens=False) for t in (QUERY, TEXTS[2])]
    assert llm.engine.encode_pair(ids[0], ids[1]) == tok(QUERY, TEXTS[2])["input_ids"]
    assert llm.score(ids[0], [ids[1]], use_tqdm=False)[0].outputs.score == pytest.approx(want[2], abs=1e-5)


def test_mean_pooling_classifier_probabilities(encoder_checkpoint):
    """classifier_pooling "mean": the head reads each prompt's own rows of a padded batch."""
    path = encoder_checkpoint("modernbert_mean_classifier")
    llm = _llm(path)
    tok, model = llm.get_tokenizer(), hf_model(path)
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits[0].softmax(-1).tolist() for t in TEXTS]
    outs = llm.classify(TEXTS, use_tqdm=False)
    assert llm.engine.num_batched_tokens > sum(len(o.prompt_token_ids) for o in outs)  # padded
    for o, w in zip(outs, want, strict=True):
        assert o.error is None and o.outputs.num_classes == 3
        assert o.outputs.probs == pytest.approx(w, abs=1e-5)


def test_params_and_config_errors(encoder_checkpoint, capsys):
    from flashpage.inspect import main as inspect_main

    path = encoder_checkpoint("modernbert_reranker")
    assert inspect_main([str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    model = LLM(str(path), dtype="float32", device="cpu").engine.model
    assert info["params"] == sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in hf_model(path).parameters())
    raw = json.loads((path / "config.json").read_text())
    for change, field in [({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
                          ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
                           "rope_parameters"),
                          ({"classifier_pooling": "max"}, "classifier_pooling"),
                          ({"hidden_activation": "swish"}, "hidden_activation"),
                          ({"classifier_activation": "tanhh"}, "classifier_activation"),
                          ({"layer_types": ["full_attention"]}, "layer_types"),
                          ({"layer_types": None, "global_attn_every_n_layers": 0}, "global_attn_every_n_layers"),
                          ({"local_attention": 0}, "local_attention"),
                          ({"num_attention_heads": 64}, "must be even"),
                          ({"global_rope_theta": -1.0, "rope_parameters": None}, "global_rope_theta")]:
        with pytest.raises(ConfigError, match=field):
            EncoderConfig.from_hf({k: v for k, v in {**raw, **change}.items() if v is not None})
    # fields transformers' ModernBERT does not read are ignored, as it ignores them (the Hub's
    # configs carry position_embedding_type "absolute")
    assert EncoderConfig.from_hf({**raw, "position_embedding_type": "absolute", "type_vocab_size": 2,
                                  "reference_compile": True}) == EncoderConfig.from_hf(raw)
    # the base architecture from model_type alone
    bare = {k: v for k, v in raw.items() if k != "architectures"}
    assert EncoderConfig.from_hf(bare).architecture == "ModernBertModel"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bits_on_the_gpu(encoder_checkpoint, dtype, monkeypatch):
    """CUDA in 16 bits (SDPA with the key mask, the band and keys of a local layer, or its
    blocks for the long prompts): close to transformers' fp32 on the CPU, ragged batches and
    one prompt alone alike."""
    from flashpage.encoder import layers

    words = " ".join(TEXTS).split()
    long_texts = [" ".join(words[:40]), " ".join(words[3:50])]
    path = encoder_checkpoint("modernbert_biased")
    llm = _llm(path, dtype=dtype, device="cuda")
    want = _hf_mean(path, llm.get_tokenizer(), TEXTS + long_texts)
    outs = llm.embed(TEXTS, use_tqdm=False) + llm.embed(TEXTS[2:3], use_tqdm=False)
    monkeypatch.setattr(layers, "LOCAL_BLOCK_MIN", 2)  # blocks of 8 from 32 tokens
    outs += llm.embed(long_texts, use_tqdm=False)
    for o, w in zip(outs, want[: len(TEXTS)] + want[2:3] + want[len(TEXTS):], strict=True):
        cos = torch.nn.functional.cosine_similarity(torch.tensor(o.outputs.embedding), w, dim=0)
        assert cos > 0.995, (dtype, float(cos))
    monkeypatch.undo()
    path = encoder_checkpoint("modernbert_reranker")
    llm = _llm(path, dtype=dtype, device="cuda")
    tok, model = llm.get_tokenizer(), hf_model(path)
    with torch.no_grad():
        want_s = [torch.sigmoid(model(**tok(QUERY, t, return_tensors="pt")).logits[0, 0]).item()
                  for t in TEXTS]
    got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    assert got == pytest.approx(want_s, abs=3e-2)
