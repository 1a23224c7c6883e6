"""Decoder sequence classifiers (Llama / Qwen2 ...ForSequenceClassification, models/llama.py):
LLM.classify equals softmax / sigmoid of transformers' logits at the last prompt token, with
chunked prefill and prefix-cache hits, and leaves no KV block behind; LLM.score on a
one-label classifier scores the tokenizer's pair encoding; generation, embedding and a
several-label score are refused; the server's /classify and /score serve them."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from flashpage import LLM, PoolingParams, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from tests.byte_tokenizer import VOCAB_SIZE, build_byte_tokenizer
from tests.server.conftest import live_server

# (HF config class, architecture, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", dict(num_key_value_heads=2)),
}
ENGINE = dict(dtype="float32", device="cpu", block_size=8, num_gpu_blocks=64,
              max_num_batched_tokens=16, max_model_len=256)  # 16 tokens a step: chunks
# lengths 3, 7, 16 (two whole blocks: its last token is still run), 20, and 33, which extends
# the 20-token one: a cached prefix
PROMPTS = [[5, 6, 7], list(range(10, 17)), list(range(40, 56)),
           [(7 * i + 3) % 300 + 4 for i in range(20)], [(7 * i + 3) % 300 + 4 for i in range(33)]]
LABELS = {3: {"0": "neg", "1": "neutral", "2": "pos"}, 1: {"0": "relevant"}}


def build_classifier(path, family: str, num_labels: int, seed: int = 0):
    """A tiny random *ForSequenceClassification checkpoint (fp32) with the byte tokenizer."""
    import transformers

    cfg_cls, arch, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_labels=num_labels, id2label=LABELS[num_labels], architectures=[arch], **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider than the default init: logits far apart
        for n, p in model.named_parameters():
            p.normal_(0, 0.2) if "norm" not in n else p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(path)
    return path


def _reference(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits of each prompt alone (unpadded: its last token is pooled)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[tuple[str, int], object] = {}

    def get(family: str, num_labels: int):
        key = (family, num_labels)
        if key not in cache:
            cache[key] = build_classifier(tmp_path_factory.mktemp(f"{family}_cls{num_labels}"),
                                          family, num_labels)
        return cache[key]

    return get


@pytest.mark.parametrize(("family", "num_labels"), [("llama", 3), ("qwen2", 1)])
def test_classify_matches_transformers(checkpoints, family, num_labels):
    path = checkpoints(family, num_labels)
    llm = LLM(str(path), **ENGINE)
    mc = llm.engine.model_config
    assert mc.is_classifier and mc.num_labels == num_labels
    assert mc.labels == tuple(LABELS[num_labels].values())
    want = [(logit.softmax(-1) if num_labels > 1 else torch.sigmoid(logit)).tolist()
            for logit in _reference(path, PROMPTS)]
    first = llm.classify(PROMPTS[:4], use_tqdm=False)  # 46 tokens: chunked over steps
    hits = llm.engine.kv_manager.prefix_hits
    again = llm.classify(PROMPTS, use_tqdm=False)  # PROMPTS[4] over PROMPTS[3]'s cached blocks
    assert llm.engine.kv_manager.prefix_hits > hits
    for outs, ref in ((first, want[:4]), (again, want)):
        for o, w in zip(outs, ref, strict=True):
            assert o.error is None and o.outputs.num_classes == num_labels
            assert o.outputs.probs == pytest.approx(w, abs=1e-5)
    if num_labels > 1:
        assert len({round(o.outputs.probs[0], 4) for o in again}) == len(PROMPTS)  # told apart
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks  # no leaks


def test_classify_through_piecewise_steps(checkpoints, monkeypatch):
    """The steps through the piecewise graphs' padded buckets (run eagerly on the CPU; the
    only graphs a classifier captures, its steps all reading hidden states): the same
    probabilities as the plain steps."""
    from flashpage.engine.cuda_graph import PiecewiseGraphs

    path = checkpoints("qwen2", 1)
    want = [o.outputs.probs for o in LLM(str(path), **ENGINE).classify(PROMPTS, use_tqdm=False)]
    llm = LLM(str(path), **ENGINE)
    llm.engine.runner.capture_piecewise_graphs(16, capture=False)
    calls = []
    real = PiecewiseGraphs.run

    def spy(self, input_ids, positions, md):
        calls.append(md.num_actual_tokens)
        return real(self, input_ids, positions, md)

    monkeypatch.setattr(PiecewiseGraphs, "run", spy)
    outs = llm.classify(PROMPTS, use_tqdm=False)
    assert calls and any(n % 16 for n in calls)  # padded buckets
    for o, w in zip(outs, want, strict=True):
        assert o.outputs.probs == pytest.approx(w, abs=1e-5)


def test_ignored_token_through_the_sampling_kernel(checkpoints):
    """On CUDA the one ignored token is drawn by the Gumbel-max kernel from the score logits
    ([n, 1] here, not a vocabulary's width): run it (interpreted) on the CPU."""
    pytest.importorskip("triton")
    path = checkpoints("qwen2", 1)
    want = [o.outputs.probs for o in LLM(str(path), **ENGINE).classify(PROMPTS[:2], use_tqdm=False)]
    llm = LLM(str(path), **ENGINE)
    llm.engine.runner.sampler.use_kernel = True
    outs = llm.classify(PROMPTS[:2], use_tqdm=False)
    assert [o.outputs.probs[0] for o in outs] == pytest.approx([w[0] for w in want], abs=1e-6)


def test_classify_through_preemption(checkpoints):
    """Five blocks of 8 tokens, priority scheduling: a 33-token prompt half run is preempted
    by a more urgent one that needs its blocks, then runs again from the start; both get
    the probabilities they get alone."""
    path = checkpoints("llama", 3)
    a, b = PROMPTS[4], PROMPTS[4][::-1]
    want = [o.outputs.probs for o in LLM(str(path), **ENGINE).classify([a, b], use_tqdm=False)]
    eng = LLM(str(path), **{**ENGINE, "num_gpu_blocks": 5, "enable_prefix_caching": False,
                            "scheduling_policy": "priority"}).engine
    eng.add_request("a", a, PoolingParams(task="classify"), priority=1)
    outs = eng.step()
    eng.add_request("b", b, PoolingParams(task="classify"), priority=0)
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert eng.scheduler.num_preemptions > 0
    got = {o.request_id: o.embedding.tolist() for o in outs if o.finished}
    assert got["a"] == pytest.approx(want[0], abs=1e-5)
    assert got["b"] == pytest.approx(want[1], abs=1e-5)
    assert eng.kv_manager.num_free_blocks == eng.num_blocks


def test_score_and_refusals(checkpoints):
    path = checkpoints("qwen2", 1)
    llm = LLM(str(path), **ENGINE)
    tok = llm.get_tokenizer()
    query, docs = "yes no maybe", ["the quick brown fox", "positive negative", "yes"]
    pairs = [tok(query, d)["input_ids"] for d in docs]  # vLLM's: the tokenizer's pair encoding
    want = [torch.sigmoid(logit)[0].item() for logit in _reference(path, pairs)]
    got = llm.score(query, docs, use_tqdm=False)
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-5)
    eng = llm.engine  # a classify and a score request in one batch: the same sigmoid
    eng.add_request("c", pairs[0], PoolingParams(task="classify"))
    eng.add_request("s", pairs[0], PoolingParams(task="score"))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    both = {o.request_id: o.embedding.tolist() for o in outs if o.finished}
    assert both["c"] == both["s"] == pytest.approx([want[0]], abs=1e-5)
    # text prompts classify as their token ids do; a mixed batch with an embedding-free engine
    assert llm.classify(docs[0], use_tqdm=False)[0].outputs.probs == pytest.approx(
        llm.classify([tok.encode(docs[0])], use_tqdm=False)[0].outputs.probs, abs=1e-6)
    with pytest.raises(ValueError, match="sequence classifier: use classify"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="sequence classifier: use classify"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="does not embed"):
        llm.embed([[5, 6, 7]])
    with pytest.raises(ValueError, match="sequence classifier"):  # the engine refuses it too
        llm.engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=2))
    three = LLM(str(checkpoints("llama", 3)), **ENGINE)
    with pytest.raises(ValueError, match="has 3 labels"):
        three.score("a", ["b"])
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_a_plain_decoder_neither_classifies_nor_scores_a_pair(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen2_bias")), **ENGINE)
    with pytest.raises(ValueError, match="not a sequence classifier"):
        llm.classify([[5, 6, 7]])
    with pytest.raises(ValueError, match="no classification head"):
        llm.engine.add_request(None, [5, 6, 7], PoolingParams(task="score"))
    assert len(llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding) == 64  # it embeds


def test_classifier_config(tmp_path):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, architectures=["Qwen2ForSequenceClassification"],
                model_type="qwen2")
    mc = ModelConfig.from_hf(base)  # no num_labels, no id2label: transformers' 2
    assert (mc.num_labels, mc.labels, mc.score_activation) == (2, ("LABEL_0", "LABEL_1"), "softmax")
    assert ModelConfig.from_hf({**base, "num_labels": 1}).score_activation == "sigmoid"
    assert ModelConfig.from_hf({**base, "num_labels": 1, "problem_type": "regression"}
                               ).score_activation == "identity"
    assert ModelConfig.from_hf({**base, "num_labels": 4, "problem_type": "multi_label_classification"}
                               ).score_activation == "sigmoid"
    assert not ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"]}).is_classifier
    with pytest.raises(ConfigError, match="num_labels must be a positive integer"):
        ModelConfig.from_hf({**base, "num_labels": 0})
    with pytest.raises(ConfigError, match="outside the 2 labels"):
        ModelConfig.from_hf({**base, "num_labels": 2, "id2label": {"0": "a", "5": "b"}})
    # a sentence-transformers CrossEncoder saved with an Identity activation: raw logits
    (tmp_path / "config.json").write_text(json.dumps({**base, "num_labels": 1}))
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.linear.Identity"}))
    assert ModelConfig.from_hf(tmp_path).score_activation == "identity"
    # the encoders' classifiers follow the same rule
    from flashpage.encoder.config import EncoderConfig

    bert = dict(architectures=["BertForSequenceClassification"], vocab_size=64, hidden_size=32,
                num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                max_position_embeddings=64)
    assert EncoderConfig.from_hf({**bert, "num_labels": 3}).score_activation == "softmax"
    assert EncoderConfig.from_hf({**bert, "num_labels": 1}).score_activation == "sigmoid"
    assert EncoderConfig.from_hf({**bert, "num_labels": 3, "problem_type": "multi_label_classification"}
                                 ).score_activation == "sigmoid"


def test_inspect_a_classifier(checkpoints, capsys):
    from flashpage.cli import main
    from flashpage.inspect import param_counts

    path = checkpoints("llama", 3)
    assert main(["inspect", str(path)]) in (0, None)
    out = capsys.readouterr().out
    assert "LlamaForSequenceClassification" in out and "classify: 3 label(s) neg, neutral, pos" in out
    model = LLM(str(path), **ENGINE).engine.model  # the score head counted, no LM head
    assert param_counts(ModelConfig.from_hf(path))[0] == sum(p.numel() for p in model.parameters())


def test_server_classify_and_score(checkpoints):
    three, one = checkpoints("llama", 3), checkpoints("qwen2", 1)
    texts = ["the quick brown fox", "yes no maybe positive negative", "hello"]
    offline = LLM(str(three), **ENGINE).classify(texts, use_tqdm=False)
    with live_server(three, engine_kw=ENGINE) as s:
        r = httpx.post(s.url + "/classify", json={"input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        for d, o in zip(r.json()["data"], offline, strict=True):
            assert d["probs"] == pytest.approx(o.outputs.probs, abs=1e-5) and d["num_classes"] == 3
            best = max(range(3), key=o.outputs.probs.__getitem__)
            assert d["label"] == ("neg", "neutral", "pos")[best]
        for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/score", {"text_1": "a", "text_2": ["b"]}),
                           ("/v1/embeddings", {"input": "hello"})):
            r = httpx.post(s.url + path, json={"model": s.model, **body}, timeout=60)
            assert r.status_code == 400, (path, r.text)
            assert "classif" in r.json()["error"]["message"], (path, r.text)
        s.wait_idle()
    scores = [o.outputs.score for o in LLM(str(one), **ENGINE).score("yes", texts, use_tqdm=False)]
    with live_server(one, engine_kw=ENGINE) as s:
        r = httpx.post(s.url + "/rerank", json={"model": s.model, "query": "yes", "documents": texts},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = {d["index"]: d["relevance_score"] for d in r.json()["results"]}
        assert [got[j] for j in range(len(texts))] == pytest.approx(scores, abs=1e-5)
        s.wait_idle()
