"""EncoderEngine (flashpage/encoder/engine.py): batches by padded tokens, bad requests refused
alone with the reason, generation refused, priorities order the forwards, aborts drop
queued requests; ``flashpage inspect`` says an encoder has no KV cache."""

from __future__ import annotations

import json

import pytest
import torch

from flashpage import LLM, PoolingParams, SamplingParams
from flashpage.config import ConfigError
from flashpage.encoder.config import EncoderConfig
from tests.encoder_checkpoints import MAX_POSITIONS

TEXTS = ["the quick brown fox", "hello world", "a", "paged cache keys values of every token"]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 64, **kw})


def _forward_shapes(llm, monkeypatch) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    model = llm.engine.model
    real = model.forward

    def spy(ids, *args):
        shapes.append(tuple(ids.shape))
        return real(ids, *args)

    monkeypatch.setattr(model, "forward", spy)
    return shapes


def test_batches_fit_the_token_budget(encoder_checkpoint, monkeypatch):
    llm = _llm(encoder_checkpoint("bert"), max_num_batched_tokens=24)
    prompts = [[2] + list(range(5, 5 + n)) + [3] for n in (3, 20, 1, 9, 30, 2)]  # 32 > 24: alone
    alone = [llm.embed([p], use_tqdm=False)[0].outputs.embedding for p in TEXTS + prompts]
    shapes = _forward_shapes(llm, monkeypatch)
    outs = llm.embed(TEXTS + prompts, use_tqdm=False)
    assert all(b * t <= 24 or b == 1 for b, t in shapes) and sum(b for b, _ in shapes) == 10
    assert (1, 32) in shapes  # a prompt over the budget runs, by itself
    for o, want in zip(outs, alone, strict=True):  # padding never changes a prompt's vector
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), torch.tensor(want),
                                   atol=1e-5, rtol=1e-5)


def test_bad_prompts_fail_alone(encoder_checkpoint):
    llm = _llm(encoder_checkpoint("xlmr"))
    eng = llm.engine
    assert eng.max_model_len == MAX_POSITIONS  # 66 positions less RoBERTa's offset of 2
    want = llm.embed(TEXTS, use_tqdm=False)
    too_long = [0] + [5] * MAX_POSITIONS + [2]
    outs = llm.embed([TEXTS[0], too_long, TEXTS[1], [], [0, 10_000, 2], TEXTS[2], TEXTS[3]],
                     use_tqdm=False)
    assert "at most 64" in outs[1].error and "max_position_embeddings 66" in outs[1].error
    assert "empty" in outs[3].error and "outside the vocabulary" in outs[4].error
    for o, w in zip([outs[0], outs[2], outs[5], outs[6]], want, strict=True):
        assert o.error is None and o.outputs.embedding == pytest.approx(w.outputs.embedding, abs=1e-6)
    ok = [0] + [5] * (MAX_POSITIONS - 2) + [2]  # exactly the positions there are
    assert llm.embed([ok], use_tqdm=False)[0].error is None
    assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="dimensions must be at most the model's 64"):
        eng.add_request(None, TEXTS[0], PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="LoRA"):
        eng.add_request(None, TEXTS[0], PoolingParams(), lora_request=object())
    with pytest.raises(ValueError, match="max_model_len 100 is more than"):
        _llm(encoder_checkpoint("xlmr"), max_model_len=100)


def test_generation_and_wrong_tasks_refused(encoder_checkpoint):
    emb = _llm(encoder_checkpoint("bert"))
    with pytest.raises(ValueError, match="does not support generation"):
        emb.generate(TEXTS, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support generation"):
        emb.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support generation"):
        emb.engine.add_request(None, TEXTS[0], SamplingParams())
    with pytest.raises(ValueError, match="is an encoder-only embedding model"):
        emb.engine.add_request(None, TEXTS[0], PoolingParams(task="score"))
    rerank = _llm(encoder_checkpoint("bert_reranker"))
    with pytest.raises(ValueError, match="cross-encoder: it scores pairs"):
        rerank.embed(TEXTS, use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        rerank.engine.add_request(None, [2, 5, 3, 6, 3], PoolingParams(task="score", dimensions=3))
    two = _llm(encoder_checkpoint("bert_two_labels"))
    with pytest.raises(ValueError, match="2 labels; only a one-label cross-encoder gives a score"):
        two.score(TEXTS[0], TEXTS[1:], use_tqdm=False)


def test_priorities_order_forwards_and_aborts_drop(encoder_checkpoint):
    llm = _llm(encoder_checkpoint("bert"), max_num_seqs=1, scheduling_policy="priority")
    eng = llm.engine
    for i, prio in enumerate([5, 0, 3]):
        eng.add_request(f"r{i}", TEXTS[i], PoolingParams(), priority=prio)
    eng.add_request("gone", TEXTS[3], PoolingParams(), priority=-1)
    eng.abort_request("gone")
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step()]
    assert order == ["r1", "r2", "r0"]
    fcfs = _llm(encoder_checkpoint("bert"))
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.embed(TEXTS[:1], priority=[2], use_tqdm=False)


def test_config_errors_and_inspect(encoder_checkpoint, tmp_path, capsys):
    from flashpage.inspect import main as inspect_main

    path = encoder_checkpoint("xlmr_reranker")
    assert inspect_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "XLMRobertaForSequenceClassification: encoder-only" in out and "KV cache: none" in out
    assert inspect_main([str(path), "--json", "--dtype", "fp32"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_cache"] is None and info["weight_bytes"] == 4 * info["params"]
    model = LLM(str(path), dtype="float32", device="cpu").engine.model
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert inspect_main([str(path), "--dtype", "fp8"]) == 2
    assert "not quantized" in capsys.readouterr().err
    raw = json.loads((path / "config.json").read_text())
    for key, value, msg in [("hidden_act", "swish", "hidden_act 'swish' is not supported"),
                            ("position_embedding_type", "relative_key", "only absolute positions"),
                            ("num_attention_heads", 5, "not a multiple of num_attention_heads 5"),
                            ("max_position_embeddings", 2, "leaves no position")]:
        with pytest.raises(ConfigError, match=msg):
            EncoderConfig.from_hf({**raw, key: value})
