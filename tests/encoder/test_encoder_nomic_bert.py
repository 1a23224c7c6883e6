"""NomicBERT (flashpage/encoder/nomic_bert.py) on tiny random checkpoints in nomic's own form
(tests/encoder_checkpoints.py NOMIC): its embeddings equal a reference written here from
the public modeling description, per prompt and in float64, one token at a time where it
can be (rotary as complex multiplication, attention as explicit softmax sums), with no
code shared with the engine; for nomic-embed-text-v1.5's options transformers' own
NomicBertModel (its weights renamed from nomic's) agrees with both. Ragged batches split by
the token budget give each prompt's vectors as if alone; prompts are capped at
max_trained_positions; unsupported fields are ConfigErrors naming them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from flashpage import LLM
from flashpage.config import ConfigError
from flashpage.encoder.config import EncoderConfig
from tests.encoder_checkpoints import MAX_POSITIONS, NOMIC

TEXTS = ["the quick brown fox", "hello world", "paged cache keys values of every token in fixed size "
         "blocks", "a", "one two three four five six seven eight nine ten the lazy dog",
         "paris is the capital city of france"]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 40, **kw})


def reference(path, ids: list[int]) -> torch.Tensor:
    """One prompt's last hidden states [T, n_embd] (float64), from config.json and the
    safetensors file alone."""
    cfg = json.loads((path / "config.json").read_text())
    sd = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    h, nh = cfg["n_embd"], cfg["n_head"]
    d = h // nh
    rd = round(d * cfg["rotary_emb_fraction"])
    eps = cfg["layer_norm_epsilon"]
    t = len(ids)

    def lin(x, name):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    def ln(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * sd[name + ".weight"] + sd[name + ".bias"]

    def rotate(v, pos):  # v [nh, d] at position pos: channel pairs turned as complex numbers
        out = v.clone()
        for j in range(rd // 2):
            a, b = (2 * j, 2 * j + 1) if cfg["rotary_emb_interleaved"] else (j, j + rd // 2)
            angle = pos * cfg["rotary_emb_base"] ** (-2 * j / rd)
            z = torch.complex(v[:, a], v[:, b]) * complex(math.cos(angle), math.sin(angle))
            out[:, a], out[:, b] = z.real, z.imag
        return out

    acts = {"swiglu": lambda z: z / (1 + torch.exp(-z)), "glu": torch.sigmoid,
            "geglu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))),
            "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))}
    act = acts[cfg["activation_function"]]
    x = sd["embeddings.word_embeddings.weight"][ids] + sd["embeddings.token_type_embeddings.weight"][0]
    x = ln(x, "emb_ln")
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        qkv = lin(x, p + "attn.Wqkv").view(t, 3, nh, d)  # "(three h d)"
        q = torch.stack([rotate(qkv[s, 0], s) for s in range(t)])
        k = torch.stack([rotate(qkv[s, 1], s) for s in range(t)])
        v = qkv[:, 2]
        ctx = torch.zeros(t, nh, d, dtype=torch.float64)
        for head in range(nh):
            scores = (q[:, head] @ k[:, head].T) / math.sqrt(d)
            w = torch.exp(scores - scores.max(-1, keepdim=True).values)
            ctx[:, head] = (w / w.sum(-1, keepdim=True)) @ v[:, head]
        x = ln(x + lin(ctx.reshape(t, h), p + "attn.out_proj"), p + "norm1")
        if p + "mlp.fc11.weight" in sd:
            y = lin(lin(x, p + "mlp.fc11") * act(lin(x, p + "mlp.fc12")), p + "mlp.fc2")
        else:
            y = lin(act(lin(x, p + "mlp.fc1")), p + "mlp.fc2")
        x = ln(x + y, p + "norm2")
    return x


@pytest.mark.parametrize("name", sorted(NOMIC))
def test_embeddings_equal_the_reference(encoder_checkpoint, name):
    path = encoder_checkpoint(name)
    llm = _llm(path)
    tok = llm.get_tokenizer()
    assert llm.engine.model_config.family == "nomic_bert" and llm.engine.pooling_type == "mean"
    outs = llm.embed(TEXTS, use_tqdm=False)
    eng = llm.engine
    assert eng.num_forwards > 1 and eng.num_batched_tokens > sum(len(o.prompt_token_ids) for o in outs)
    for text, o in zip(TEXTS, outs, strict=True):
        ids = tok(text)["input_ids"]
        assert o.error is None and o.prompt_token_ids == ids
        want = torch.nn.functional.normalize(reference(path, ids).mean(0), dim=0).float()
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), want, atol=1e-5, rtol=1e-5)
        alone = llm.embed([text], use_tqdm=False)[0].outputs.embedding
        assert alone == pytest.approx(o.outputs.embedding, abs=1e-5)


def test_transformers_own_nomic_bert_agrees(encoder_checkpoint):
    """transformers' NomicBertModel (nomic-embed-text-v1.5's options only: SwiGLU, no biases,
    all channels rotated, rotate-half), our checkpoint's weights renamed as its conversion
    mapping renames nomic's, gives the hidden states ours and the reference give."""
    import transformers

    path = encoder_checkpoint("nomic")
    cfg = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    theirs = transformers.NomicBertConfig(
        vocab_size=sd["embeddings.word_embeddings.weight"].shape[0], hidden_size=cfg["n_embd"],
        num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"], intermediate_size=cfg["n_inner"],
        hidden_act="silu", max_position_embeddings=MAX_POSITIONS, type_vocab_size=2,
        layer_norm_eps=cfg["layer_norm_epsilon"], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rotary_emb_base"])})
    model = transformers.NomicBertModel(theirs).eval()
    renamed = {"embeddings.word_embeddings.weight": sd["embeddings.word_embeddings.weight"],
               "embeddings.token_type_embeddings.weight": sd["embeddings.token_type_embeddings.weight"],
               "embeddings.LayerNorm.weight": sd["emb_ln.weight"], "embeddings.LayerNorm.bias": sd["emb_ln.bias"]}
    for i in range(cfg["n_layer"]):
        src, dst = f"encoder.layers.{i}.", f"layers.{i}."
        for j, proj in enumerate(sd[src + "attn.Wqkv.weight"].chunk(3, dim=0)):
            renamed[dst + f"self_attn.{'qkv'[j]}_proj.weight"] = proj
        for a, b in [("attn.out_proj", "self_attn.o_proj"), ("mlp.fc11", "mlp.up_proj"),
                     ("mlp.fc12", "mlp.gate_proj"), ("mlp.fc2", "mlp.down_proj")]:
            renamed[dst + b + ".weight"] = sd[src + a + ".weight"]
        for a, b in [("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")]:
            renamed[dst + b + ".weight"], renamed[dst + b + ".bias"] = sd[src + a + ".weight"], sd[src + a + ".bias"]
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k and "token_type_ids" not in k]
    llm = _llm(path)
    tok = llm.get_tokenizer()
    for text in TEXTS:
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            hf = model(**enc).last_hidden_state[0]
        ref = reference(path, enc["input_ids"][0].tolist())
        torch.testing.assert_close(hf.double(), ref, atol=1e-4, rtol=1e-4)
        got = llm.embed([text], use_tqdm=False)[0].outputs.embedding
        want = torch.nn.functional.normalize(hf.mean(0), dim=0)
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5)


def test_unpadded_and_capped_at_trained_positions(encoder_checkpoint, monkeypatch):
    path = encoder_checkpoint("nomic")
    llm = _llm(path, max_num_batched_tokens=4096)
    eng = llm.engine
    assert eng.max_model_len == MAX_POSITIONS  # min(n_positions 8192, max_trained_positions)
    rows: list[int] = []
    eng.model.encoder.layers[1].attn.Wqkv.register_forward_hook(
        lambda m, args, out: rows.append(args[0].shape[0]))
    outs = llm.embed(TEXTS + [[2] + [5] * MAX_POSITIONS + [3]], use_tqdm=False)
    assert "at most 64" in outs[-1].error and "max_trained_positions: 64" in outs[-1].error
    assert eng.num_forwards == 1 and rows == [sum(len(o.prompt_token_ids) for o in outs[:-1])]
    with pytest.raises(ValueError, match="no classification head"):
        llm.classify(TEXTS[:1], use_tqdm=False)


def test_params_and_config_errors(encoder_checkpoint, capsys):
    from flashpage.inspect import main as inspect_main

    path = encoder_checkpoint("nomic_options")
    assert inspect_main([str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    model = LLM(str(path), dtype="float32", device="cpu").engine.model
    # the checkpoint's tensors less its unused pooler
    ours = sum(v.numel() for k, v in load_file(str(path / "model.safetensors")).items() if "pooler" not in k)
    assert info["params"] == sum(p.numel() for p in model.parameters()) == ours
    cfg = EncoderConfig.from_hf(str(path))
    assert (cfg.intermediate_size, cfg.rotary_dim, cfg.rotary_interleaved) == (256, 4, True)
    raw = json.loads((path / "config.json").read_text())
    for change, field in [({"prenorm": True}, "prenorm"), ({"parallel_block": True}, "parallel_block"),
                          ({"use_rms_norm": True}, "use_rms_norm"), ({"causal": True}, "causal"),
                          ({"rotary_emb_scale_base": 512}, "rotary_emb_scale_base"),
                          ({"rotary_head_dim": True}, "rotary_head_dim"),
                          ({"num_heads_kv": 2}, "num_heads_kv"),
                          ({"activation_function": "relu"}, "activation_function"),
                          ({"rotary_emb_fraction": 0.0}, "rotary_emb_fraction"),
                          ({"rotary_emb_fraction": 0.3}, "rotary_emb_fraction"),
                          ({"rotary_emb_base": 0}, "rotary_emb_base"),
                          ({"n_head": 5}, "n_head"), ({"n_embd": None}, "n_embd")]:
        with pytest.raises(ConfigError, match=field):
            EncoderConfig.from_hf({**raw, **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bits_on_the_gpu(encoder_checkpoint, dtype):
    """CUDA in 16 bits (SDPA with a key mask for a ragged batch, none for one prompt): close
    to the float64 reference, every variant."""
    for name in sorted(NOMIC):
        path = encoder_checkpoint(name)
        llm = _llm(path, dtype=dtype, device="cuda")
        tok = llm.get_tokenizer()
        outs = llm.embed(TEXTS, use_tqdm=False) + llm.embed(TEXTS[2:3], use_tqdm=False)
        for text, o in zip(TEXTS + TEXTS[2:3], outs, strict=True):
            want = reference(path, tok(text)["input_ids"]).mean(0).float()
            cos = torch.nn.functional.cosine_similarity(torch.tensor(o.outputs.embedding), want, dim=0)
            assert cos > 0.995, (name, dtype, float(cos))
