"""Tiny random BERT / XLM-RoBERTa / ModernBERT checkpoints (embedding models, one-label
cross-encoders, classifiers) with tokenizers made offline: a WordPiece vocabulary
(BertTokenizer; ModernBERT's too, without token types: its [CLS] a [SEP] b [SEP] is
BERT's) and a word-level tokenizer.json with RoBERTa's specials (<s> 0, <pad> 1, </s> 2,
<unk> 3). NomicBERT's (trust_remote_code upstream: no transformers class saves its form)
are written here directly: config.json in nomic's GPT-2 field names, random tensors under
its parameter names. ModernBERT's are three layers (global, local, global) with a window of
MODERNBERT_WINDOW tokens, so a prompt of a dozen tokens is longer than its window."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_SENTENCE = ("the quick brown fox jumps over lazy dog hello world paged cache keys values of every "
             "token in fixed size blocks a an is are one two three four five six seven eight nine "
             "ten paris france capital city river bank money water")
WORDS = _SENTENCE.split(" ")
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_POSITIONS = 64
MODERNBERT_WINDOW = 8  # local_attention: a local layer's query sees keys within 4 positions
_MODERNBERT = {"local_attention": MODERNBERT_WINDOW, "global_attn_every_n_layers": 2,
               "global_rope_theta": 1000.0, "local_rope_theta": 100.0}
# ModernBERT with every bias (norm_bias, attention_bias, mlp_bias, classifier_bias) and a
# tanh GELU head
_MODERNBERT_BIASED = {**_MODERNBERT, "norm_bias": True, "attention_bias": True, "mlp_bias": True,
                      "classifier_bias": True, "classifier_activation": "gelu_pytorch_tanh"}

# name -> (transformers class, family, extra config)
ENCODERS: dict[str, tuple[str, str, dict]] = {
    "bert": ("BertModel", "bert", {}),
    "bert_cls_pooling": ("BertModel", "bert", {}),  # sentence-transformers Pooling: cls (bge's)
    "bert_reranker": ("BertForSequenceClassification", "bert", {"num_labels": 1}),
    "bert_two_labels": ("BertForSequenceClassification", "bert", {"num_labels": 2}),
    "xlmr": ("XLMRobertaModel", "roberta", {}),
    "xlmr_reranker": ("XLMRobertaForSequenceClassification", "roberta", {"num_labels": 1}),
    "modernbert": ("ModernBertModel", "modernbert", _MODERNBERT),
    "modernbert_biased": ("ModernBertModel", "modernbert", _MODERNBERT_BIASED),
    "modernbert_reranker": ("ModernBertForSequenceClassification", "modernbert",
                            {**_MODERNBERT_BIASED, "num_labels": 1}),
    "modernbert_mean_classifier": ("ModernBertForSequenceClassification", "modernbert",
                                   {**_MODERNBERT, "num_labels": 3, "classifier_pooling": "mean"}),
}


# NomicBERT variants (config.json fields over NOMIC_BASE): nomic-embed-text-v1.5's form
# (SwiGLU, no biases, every channel rotated, rotate-half), and one with every option the
# others leave off (a quarter of each head rotated, interleaved, biases, GeGLU, a width
# nomic's gated MLP rounds up), and a plain GELU MLP with half the channels rotated
NOMIC_BASE = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": 64, "n_head": 4,
              "n_layer": 2, "n_positions": 8192, "max_trained_positions": MAX_POSITIONS,
              "layer_norm_epsilon": 1e-12, "type_vocab_size": 2, "rotary_emb_base": 1000,
              "rotary_scaling_factor": None, "rotary_emb_scale_base": None, "prenorm": False,
              "causal": False, "parallel_block": False, "use_rms_norm": False, "pad_vocab_size_multiple": 8}
NOMIC: dict[str, dict] = {
    "nomic": {"activation_function": "swiglu", "n_inner": 256, "rotary_emb_fraction": 1.0,
              "rotary_emb_interleaved": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
              "mlp_fc2_bias": False},
    "nomic_options": {"activation_function": "geglu", "n_inner": 200, "rotary_emb_fraction": 0.25,
                      "rotary_emb_interleaved": True, "qkv_proj_bias": True, "mlp_fc1_bias": True,
                      "mlp_fc2_bias": True},
    "nomic_gelu": {"activation_function": "gelu", "n_inner": 96, "rotary_emb_fraction": 0.5,
                   "rotary_emb_interleaved": False, "qkv_proj_bias": True, "mlp_fc1_bias": True,
                   "mlp_fc2_bias": False},
}


def nomic_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under nomic's names for a config dict of NOMIC's form (std 0.2, norm
    weights in [0.5, 1.5]; the gated MLP's width rounded up to 256 as nomic's code does)."""
    g = torch.Generator().manual_seed(seed)
    h, vocab = cfg["n_embd"], -(-cfg["vocab_size"] // cfg["pad_vocab_size_multiple"]) * cfg["pad_vocab_size_multiple"]
    gated = cfg["activation_function"] in ("swiglu", "geglu", "glu")
    inner = -(-cfg["n_inner"] // 256) * 256 if gated else cfg["n_inner"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm(name):
        return {f"{name}.weight": torch.rand(h, generator=g) + 0.5, f"{name}.bias": w(h)}

    state = {"embeddings.word_embeddings.weight": w(vocab, h),
             "embeddings.token_type_embeddings.weight": w(cfg["type_vocab_size"], h), **norm("emb_ln"),
             "pooler.dense.weight": w(h, h), "pooler.dense.bias": w(h)}  # nomic's pooler: unused
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        state |= {p + "attn.Wqkv.weight": w(3 * h, h), p + "attn.out_proj.weight": w(h, h),
                  **norm(p + "norm1"), **norm(p + "norm2"), p + "mlp.fc2.weight": w(h, inner)}
        if cfg["qkv_proj_bias"]:
            state |= {p + "attn.Wqkv.bias": w(3 * h), p + "attn.out_proj.bias": w(h)}
        ins = ("fc11", "fc12") if gated else ("fc1",)
        for name in ins:
            state[p + f"mlp.{name}.weight"] = w(inner, h)
            if cfg["mlp_fc1_bias"]:
                state[p + f"mlp.{name}.bias"] = w(inner)
        if cfg["mlp_fc2_bias"]:
            state[p + "mlp.fc2.bias"] = w(h)
    return state


def _bert_tokenizer(folder: Path, types: bool = True) -> int:
    from transformers import BertTokenizer

    vocab = BERT_SPECIALS + list(LETTERS) + ["##" + c for c in LETTERS] + WORDS
    names = {} if types else {"model_input_names": ["input_ids", "attention_mask"]}
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, **names).save_pretrained(folder)
    return len(vocab)


def _roberta_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(ROBERTA_SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                            cls_token="<s>", pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    return len(vocab)


def build_encoder_checkpoint(folder: Path, name: str, seed: int = 0, **overrides) -> Path:
    """Save the named tiny encoder (fp32 safetensors, config.json, tokenizer) in ``folder``."""
    import transformers

    if name in NOMIC:
        from safetensors.torch import save_file

        cfg = {**NOMIC_BASE, "vocab_size": _bert_tokenizer(folder), **NOMIC[name], **overrides}
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        save_file(nomic_state(cfg, seed), str(folder / "model.safetensors"))
        return folder
    cls_name, family, extra = ENCODERS[name]
    n_vocab = (_roberta_tokenizer(folder) if family == "roberta"
               else _bert_tokenizer(folder, types=family == "bert"))
    base = dict(vocab_size=n_vocab + 3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128)
    if family != "modernbert":
        base["layer_norm_eps"] = 1e-12
    if family == "bert":
        config = transformers.BertConfig(**base, max_position_embeddings=MAX_POSITIONS,
                                         type_vocab_size=2, pad_token_id=0, **extra, **overrides)
    elif family == "modernbert":  # [PAD] 0, [CLS] 2, [SEP] 3 as the WordPiece vocabulary has them
        config = transformers.ModernBertConfig(**{**base, "num_hidden_layers": 3}, norm_eps=1e-5,
                                               max_position_embeddings=MAX_POSITIONS, pad_token_id=0,
                                               cls_token_id=2, sep_token_id=3, bos_token_id=2,
                                               eos_token_id=3, **extra, **overrides)
    else:  # XLM-R: positions start after pad (1), so 2 more than the longest prompt
        config = transformers.XLMRobertaConfig(**base, max_position_embeddings=MAX_POSITIONS + 2,
                                               type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                               eos_token_id=2, **extra, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    # Random init is tiny (std 0.02): widen it so the outputs differ between prompts.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "LayerNorm.weight" in n or n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    if name == "bert_cls_pooling":
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_cls_token": True,
             "pooling_mode_mean_tokens": False}))
    return folder


def hf_model(folder: Path):
    """transformers' model of a checkpoint built above (fp32, eval)."""
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()
