"""vLLM's hf_overrides (config.apply_hf_overrides) and a causal LM served as a reranker
(models/seq_cls_from_lm.py, Qwen3-Reranker's recipe): LLM.score of a Qwen3ForCausalLM /
LlamaForCausalLM checkpoint overridden to *ForSequenceClassification with
classifier_from_token ["no", "yes"] equals transformers' softmax over the [no, yes] logits
at the last token of the same ids (P(yes)), the pair joined as the one text a + b (vLLM's
use_pad_token false), through /score too; one token: the sigmoid of its logit; other
overridden fields reach the engine's config; the errors (bad JSON on the CLI, a token that
is several tokens, a causal LM served as a classifier without the override, overrides on an
encoder model)."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM
from flashpage.config import ConfigError, EngineConfig, ModelConfig, apply_hf_overrides
from flashpage.models.loader import ModelLoadError

WORDS = ["yes", "no", "Yes", "query", "document", "is", "the", "answer", "relevant", "a",
         "cat", "dog", "sat", "on", "mat", "Judge", ":", "?"]
VOCAB = ["<pad>", "<s>", "</s>", "<unk>", *WORDS]
VOCAB_SIZE = 32  # the model's: wider than the tokenizer's (as real checkpoints pad theirs)
ENGINE = dict(dtype="float32", device="cpu", block_size=8, num_gpu_blocks=32,
              max_num_batched_tokens=16, max_model_len=128)
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
FAMILIES = {  # (HF config class, causal LM architecture, its classifier, tied embeddings)
    "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", True),
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", False),
}


def build_word_tokenizer(folder) -> None:
    """A word-level tokenizer (split on whitespace and punctuation) over VOCAB: "yes" and
    "no" are one token each, "no yes" two; a prompt starts with <s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)


def build_causal_lm(path, family: str):
    import transformers

    cfg_cls, _, tied = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider than the default init: P(yes) far from 1/2
        for n, p in model.named_parameters():
            p.normal_(0, 0.3) if "norm" not in n else p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    build_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def causal_lms(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = build_causal_lm(tmp_path_factory.mktemp(f"{family}_lm"), family)
        return cache[family]

    return get


def _last_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' next-token logits at each prompt's last token (the whole vocabulary)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]


# text_2 opens with its space, as Qwen3-Reranker's template splits between the two texts
PAIRS = [("query : the cat sat on the mat ?", " document : a cat sat on a mat"),
         ("query : the cat sat on the mat ?", " document : the dog is the answer"),
         ("Judge : is the document relevant ?", " the answer is yes")]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_two_token_reranker_is_p_yes(causal_lms, family):
    """Qwen3-Reranker's overrides: score = softmax(logits[[no, yes]])[yes] of transformers'
    causal LM at the pair's last token (qwen3 here has tied embeddings: the head is
    embed_tokens' rows; llama its own lm_head)."""
    path = causal_lms(family)
    llm = LLM(str(path), hf_overrides={**QWEN3_RERANKER,
                                       "architectures": [FAMILIES[family][1]]}, **ENGINE)
    mc = llm.engine.model_config
    assert mc.is_classifier and mc.num_labels == 1 and mc.score_activation == "sigmoid"
    assert mc.classifier_from_token == ("no", "yes") and mc.classifier_method == "from_2_way_softmax"
    tok = llm.get_tokenizer()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    # vLLM's use_pad_token false for an LM made a reranker: the pair is the one text a + b
    assert not mc.use_pad_token
    ids = [llm.engine.encode_pair(a, b) for a, b in PAIRS]
    assert ids == [tok(a + b)["input_ids"] for a, b in PAIRS]
    assert llm.engine.encode_pair([1, 7, 8], [9]) == [1, 7, 8, 9]  # ids: as given, joined
    want = [logits[[no, yes]].softmax(-1)[1].item() for logits in _last_logits(path, ids)]
    got = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS],
                                              use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(w, 3) for w in want}) == len(PAIRS)  # told apart
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_score_through_the_server_and_use_pad_token(causal_lms):
    """/score joins the pair as LLM.score does (one text); use_pad_token true in hf_overrides
    asks for the tokenizer's pair encoding instead (here <s> a b: no separator)."""
    import httpx

    from tests.server.conftest import live_server

    path = causal_lms("qwen3")
    left, right = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    want = [o.outputs.score for o in LLM(str(path), hf_overrides=QWEN3_RERANKER, **ENGINE).score(
        left, right, use_tqdm=False)]
    with live_server(path, engine_kw={**ENGINE, "hf_overrides": QWEN3_RERANKER}) as s:
        r = httpx.post(s.url + "/score", json={"model": s.model, "text_1": left, "text_2": right},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
        s.wait_idle()
    llm = LLM(str(path), hf_overrides={**QWEN3_RERANKER, "use_pad_token": True}, **ENGINE)
    assert llm.engine.model_config.use_pad_token
    tok = llm.get_tokenizer()
    assert llm.engine.encode_pair(*PAIRS[0]) == tok(*PAIRS[0])["input_ids"]


def test_one_token_is_the_sigmoid_of_its_logit(causal_lms):
    """bge-reranker-v2-gemma's kind: ["Yes"], no_post_processing: sigmoid(logit("Yes"))."""
    path = causal_lms("llama")
    llm = LLM(str(path), hf_overrides={"architectures": ["LlamaForSequenceClassification"],
                                       "classifier_from_token": ["Yes"],
                                       "method": "no_post_processing"}, **ENGINE)
    assert llm.engine.model_config.num_labels == 1
    y = llm.get_tokenizer().convert_tokens_to_ids("Yes")
    prompts = [[1, 7, 8, 9], [1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    want = [torch.sigmoid(logits[y]).item() for logits in _last_logits(path, prompts)]
    got = [o.outputs.probs[0] for o in llm.classify(prompts, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)


def test_no_post_processing_labels_are_the_tokens(causal_lms):
    """Several tokens without 2-way softmax: one label each (softmax over their logits)."""
    path = causal_lms("qwen3")
    llm = LLM(str(path), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                       "classifier_from_token": ["no", "yes", "Yes"],
                                       "method": "no_post_processing"}, **ENGINE)
    mc = llm.engine.model_config
    assert mc.num_labels == 3 and mc.labels == ("no", "yes", "Yes") and mc.score_activation == "softmax"
    rows = llm.get_tokenizer().convert_tokens_to_ids(["no", "yes", "Yes"])
    prompt = [1, 7, 8, 9, 10]
    want = _last_logits(path, [prompt])[0][rows].softmax(-1).tolist()
    assert llm.classify([prompt], use_tqdm=False)[0].outputs.probs == pytest.approx(want, abs=1e-5)


def test_override_of_another_field_reaches_the_config(causal_lms):
    path = causal_lms("llama")
    llm = LLM(str(path), hf_overrides={"max_position_embeddings": 96,
                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
              **{**ENGINE, "max_model_len": None})
    mc = llm.engine.model_config
    assert mc.max_position_embeddings == 96 and llm.engine.max_model_len == 96
    assert mc.rope_scaling is not None and mc.rope_scaling.factor == 2.0
    assert not mc.is_classifier  # still the causal LM: it generates
    assert ModelConfig.from_hf(str(path)).max_position_embeddings == 512  # the file is untouched


def test_apply_hf_overrides_merges_dicts():
    d = {"a": 1, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "archs": ["X"]}
    out = apply_hf_overrides(d, {"rope_scaling": {"factor": 8.0}, "archs": ["Y"], "new": None})
    assert out == {"a": 1, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}, "archs": ["Y"],
                   "new": None}
    assert d["rope_scaling"]["factor"] == 4.0  # not modified


def test_bad_overrides_are_refused():
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        EngineConfig(hf_overrides='{"num_labels": 1}')  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        EngineConfig(hf_overrides=["architectures"])  # type: ignore[arg-type]
    base = {"architectures": ["Qwen3ForSequenceClassification"], "vocab_size": 32,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "model_type": "qwen3"}
    with pytest.raises(ConfigError, match="from_2_way_softmax needs two"):
        ModelConfig.from_hf(base, {"classifier_from_token": ["yes"], "method": "from_2_way_softmax"})
    with pytest.raises(ConfigError, match="method must be one of"):
        ModelConfig.from_hf(base, {"classifier_from_token": ["yes"], "method": "softmax3"})
    with pytest.raises(ConfigError, match="non-empty list of token strings"):
        ModelConfig.from_hf(base, {"classifier_from_token": "yes"})
    with pytest.raises(ConfigError, match="needs classifier_from_token"):
        ModelConfig.from_hf(base, {"is_original_qwen3_reranker": True})


def test_encoder_model_refuses_hf_overrides(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 32, "hidden_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}))
    with pytest.raises(ValueError, match="hf_overrides apply to decoder models"):
        LLM(str(tmp_path), hf_overrides={"num_labels": 1}, device="cpu")


def test_cli_hf_overrides(capsys):
    from flashpage.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--hf-overrides", '{"num_labels": 1}', "x"])
    assert args.hf_overrides == {"num_labels": 1}
    for bad in ('{"num_labels": 1', '["architectures"]'):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--hf-overrides", bad])
    err = capsys.readouterr().err
    assert "--hf-overrides" in err and "not JSON" in err and "must be a JSON object" in err


def test_multi_token_classifier_token_is_refused(causal_lms):
    with pytest.raises(ModelLoadError, match=r"'no yes' is 2 tokens .* exactly one token"):
        LLM(str(causal_lms("llama")), hf_overrides={
            "architectures": ["LlamaForSequenceClassification"],
            "classifier_from_token": ["no yes"]}, **ENGINE)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_causal_lm_as_classifier_needs_the_override(causal_lms, family):
    """No score.weight and no classifier_from_token: the error names the weight and the fix
    (llama's checkpoint holds lm_head.weight; tied qwen3's holds no head at all)."""
    with pytest.raises(ModelLoadError, match=r"score\.weight.*classifier_from_token"):
        LLM(str(causal_lms(family)), hf_overrides={"architectures": [FAMILIES[family][1]]},
            **ENGINE)
