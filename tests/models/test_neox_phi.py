"""GPT-NeoX / Pythia (per-head fused query_key_value, LayerNorms with bias, parallel or
sequential residual, partial rotary, untied embed_out) and Phi-1/1.5/2 (one LayerNorm
feeding attention and MLP in parallel, partial rotary, qk_layernorm, an LM head with a
bias): models/gpt_neox.py, phi.py, on Llama's attention and loading under their names.

CPU, fp32: greedy tokens equal transformers' for each family; prompt logprobs equal
transformers' log-softmax (Phi's LM-head bias shown to matter there); chunked prefill,
preemption and prefix hits; query_key_value's per-head rows regrouped into our q, k, v;
weights back under HF's names and the LoRA targets under them; a missing tensor named
under the checkpoint's name; ``flashpage inspect``'s parameter counts (tiny checkpoints,
and Pythia-70M / Phi-2 shapes against transformers on the meta device) and rotary row;
config fields (old-style Pythia keys) and errors.
Our Triton kernels at Phi-2's head_dim 80 and NeoX-20B's 96 (interpreter; padded heads).
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens,
and bf16 follows fp32 about as far as transformers' bf16 does; head dims 80 and 96 default
to the triton backend.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import param_counts
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    _save_tiny_routed,
    assert_dense_params_match_hf,
    assert_edit_refused,
    assert_gpu_graphs_match_hf,
    assert_missing_tensor_named,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    cpu_llm,
    edited_copy,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
)
from tests.peft_adapter import assert_adapter_gives_merged_tokens, write_named_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

LAYERS = dict(num_hidden_layers=2)
# name -> (HF config class name, extra config kwargs); 2 layers, hidden 64, 4 heads of 16
TINY: dict[str, tuple[str, dict]] = {
    # Pythia's shape: parallel residual, biases, 1/4 of each head rotated, untied embed_out
    "neox": ("GPTNeoXConfig", dict(LAYERS, rotary_pct=0.25, layer_norm_eps=1e-4)),
    # sequential residual, no attention bias, tied head, gelu_fast, half the head rotated
    # at base 500; its config.json rewritten in Pythia's old keys (rotary_pct,
    # rotary_emb_base), which transformers and we both read
    "neox_sequential": ("GPTNeoXConfig", dict(LAYERS, use_parallel_residual=False,
                                              attention_bias=False, tie_word_embeddings=True,
                                              hidden_act="gelu_fast", rotary_pct=0.5,
                                              rotary_emb_base=500)),
    # Phi-2's shape: MHA, half of each head rotated, gelu_new, biased LM head
    "phi": ("PhiConfig", dict(LAYERS)),
    # qk_layernorm, GQA, 3/4 rotated, the head tied to the embeddings (its bias not)
    "phi_qk_gqa": ("PhiConfig", dict(LAYERS, qk_layernorm=True, num_key_value_heads=2,
                                     partial_rotary_factor=0.75, tie_word_embeddings=True)),
}
NAMES = sorted(TINY)
OLD_STYLE = {"neox_sequential": dict(rotary_pct=0.5, rotary_emb_base=500)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    cls_name, extra = TINY[name]
    _save_tiny_routed(path, cls_name, {**extra, **overrides}, seed, False)
    if name in OLD_STYLE:
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("rope_parameters")
        cfg.update(OLD_STYLE[name])
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    prompts = random_prompts(3, 5, 40, seed=1)
    llm = cpu_llm(path)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves: each prompt token's logprob is transformers' log-softmax;
    Phi's without its LM-head bias would be others."""
    path = tiny(name)
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = cpu_llm(path).generate([prompt], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    rows, nxt = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, logits.log_softmax(-1)[rows, nxt], atol=1e-4, rtol=1e-4)
    if name.startswith("phi"):
        unbiased = (logits - hf.lm_head.bias).log_softmax(-1)[rows, nxt]
        assert not torch.allclose(got, unbiased, atol=1e-2)


@pytest.mark.parametrize("name", ["neox", "phi_qk_gqa"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


def test_query_key_value_rows_regrouped_per_head(tiny):
    """Our qkv_proj's q, k and v for an input are transformers' (its [heads, 3 x head_dim]
    view of query_key_value, chunked), bias included."""
    path = tiny("neox")
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.model.layers[1].self_attn.qkv_proj(x).split(64, dim=-1)
        want = hf.gpt_neox.layers[1].attention.query_key_value(x).view(5, 4, 48).chunk(3, dim=-1)
    for got, w in zip(ours, want, strict=True):
        torch.testing.assert_close(got, w.reshape(5, 64), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------- loading, inspect
LORA = {
    "neox": {"gpt_neox.layers.1.attention.dense": ("model.layers.1.self_attn.o_proj", 0, 64),
             "gpt_neox.layers.1.mlp.dense_h_to_4h": ("model.layers.1.mlp.c_fc", 0, 128),
             "gpt_neox.layers.1.mlp.dense_4h_to_h": ("model.layers.1.mlp.c_proj", 0, 64)},
    "phi_qk_gqa": {"model.layers.1.self_attn.k_proj": ("model.layers.1.self_attn.qkv_proj", 64, 32),
                   "model.layers.1.self_attn.dense": ("model.layers.1.self_attn.o_proj", 0, 64),
                   "model.layers.1.mlp.fc1": ("model.layers.1.mlp.c_fc", 0, 128),
                   "model.layers.1.mlp.fc2": ("model.layers.1.mlp.c_proj", 0, 64)},
}


@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    path = tiny(name)
    model, ref = load_and_round_trip(
        path, "embed_out.weight" if name.startswith("neox") else "lm_head.weight")
    if name.startswith("phi"):
        assert "lm_head.bias" in ref
    if name in LORA:
        targets = model.lora_targets()
        assert LORA[name].items() <= targets.items()
        assert len(targets) == 2 * (4 if name == "neox" else 6)  # query_key_value whole


def test_checkpoint_mask_buffers_are_skipped(tiny, tmp_path):
    """Pythia's files hold the causal mask buffers (attention.bias, masked_bias) and
    rotary_emb.inv_freq: read past, as transformers does."""

    def add(t):
        t["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
        t["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
        t["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)

    path = edited_copy(tiny("neox"), tmp_path / "with_buffers", edit=add)
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    assert "gpt_neox.layers.0.attention.bias" not in dict(model.hf_weights())


# name -> the HF modules a LoRA adapter adapts (in both layers), in_features, out_features
LORA_MODULES = {
    "neox": {"attention.query_key_value": (64, 192), "attention.dense": (64, 64),
             "mlp.dense_h_to_4h": (64, 128), "mlp.dense_4h_to_h": (128, 64)},
    "phi_qk_gqa": {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (64, 32),
                   "self_attn.dense": (64, 64), "mlp.fc1": (64, 128), "mlp.fc2": (128, 64)},
}


@pytest.mark.parametrize("name", sorted(LORA_MODULES))
def test_lora_adapter_under_hf_names_gives_the_merged_checkpoints_tokens(tiny, tmp_path, name):
    """A PEFT adapter naming the family's own modules (gpt_neox.layers.N.mlp.dense_h_to_4h,
    model.layers.N.mlp.fc1 ...; NeoX's fused query_key_value, its lora_B rows regrouped
    as the weight's) gives transformers' tokens of the checkpoint with it merged."""
    prefix = "gpt_neox.layers" if name == "neox" else "model.layers"
    adapter = write_named_adapter(tmp_path / "adapter", {
        f"{prefix}.{layer}.{module}": shape for layer in range(2)
        for module, shape in LORA_MODULES[name].items()})
    assert_adapter_gives_merged_tokens(tiny(name), adapter, tmp_path)


@pytest.mark.parametrize(("name", "dropped"), [
    ("neox", "gpt_neox.layers.1.mlp.dense_4h_to_h.bias"),
    ("neox", "gpt_neox.layers.0.attention.query_key_value.weight"),
    ("phi", "lm_head.bias"),
    ("phi", "model.layers.0.self_attn.dense.weight"),
])
def test_missing_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path, name, dropped):
    assert_missing_tensor_named(tiny(name), tmp_path, dropped)


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("neox", lambda t: t.update({"gpt_neox.layers.0.attention.extra.weight": torch.ones(2)}),
     "checkpoint tensor 'gpt_neox.layers.0.attention.extra.weight' has no place"),
    ("neox", lambda t: t.update({"gpt_neox.layers.1.mlp.dense_4h_to_h.bias": torch.ones(3)}),
     r"gpt_neox.layers.1.mlp.dense_4h_to_h.bias: checkpoint shape \(3,\) != \(64,\)"),
    ("neox", lambda t: t.update({"gpt_neox.layers.0.attention.query_key_value.bias": torch.ones(96)}),
     r"query_key_value.bias: checkpoint shape \(96,\) does not have 3 x 4 heads x 16 = 192 rows"),
    ("phi", lambda t: t.update({"model.final_layernorm.bias": torch.ones(3)}),
     r"model.final_layernorm.bias: checkpoint shape \(3,\) != \(64,\)"),
])
def test_bad_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path, name, edit, message):
    assert_edit_refused(tiny(name), tmp_path, edit, message)


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


# config.json as published (EleutherAI/pythia-70m: the old rotary keys; microsoft/phi-2)
PYTHIA_70M = dict(architectures=["GPTNeoXForCausalLM"], bos_token_id=0, eos_token_id=0,
                  hidden_act="gelu", hidden_size=512, intermediate_size=2048,
                  layer_norm_eps=1e-05, max_position_embeddings=2048, model_type="gpt_neox",
                  num_attention_heads=8, num_hidden_layers=6, rotary_emb_base=10000,
                  rotary_pct=0.25, tie_word_embeddings=False, torch_dtype="float16",
                  use_parallel_residual=True, vocab_size=50304)
PHI_2 = dict(architectures=["PhiForCausalLM"], bos_token_id=50256, eos_token_id=50256,
             hidden_act="gelu_new", hidden_size=2560, intermediate_size=10240,
             layer_norm_eps=1e-05, max_position_embeddings=2048, model_type="phi",
             num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
             partial_rotary_factor=0.4, qk_layernorm=False, rope_scaling=None,
             rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float16",
             vocab_size=51200)


@pytest.mark.parametrize("raw", [PYTHIA_70M, PHI_2], ids=["pythia-70m", "phi-2"])
def test_inspect_counts_real_shapes(raw):
    """Pythia-70M's and Phi-2's parameters as transformers builds them (meta device)."""
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    total, active = param_counts(ModelConfig.from_hf(dict(raw)))
    assert total == active == hf.num_parameters()


def test_inspect_reports_partial_rotary(tmp_path, capsys):
    from flashpage.inspect import main

    for name, raw, line in (("pythia", PYTHIA_70M, "first 16 of 64 dims"),
                            ("phi2", PHI_2, "first 32 of 80 dims")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        assert main([str(tmp_path / name), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        head_dim = raw["hidden_size"] // raw["num_attention_heads"]
        assert (info["head_dim"], info["rotary_dim"]) == (head_dim, int(line.split()[1]))
        # MHA: 2 x heads x head_dim values a token a layer, 2 bytes each in bf16
        assert info["kv_bytes_per_token"] == 2 * raw["hidden_size"] * 2 * raw["num_hidden_layers"]
        assert main([str(tmp_path / name)]) == 0
        assert line in capsys.readouterr().out


def _raw(name: str, **edit) -> dict:
    cls_name, extra = TINY[name]
    d = getattr(transformers, cls_name)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=512, **extra).to_dict()
    d["architectures"] = [cls_name.replace("Config", "ForCausalLM")]
    d.update(edit)
    return d


def test_config_fields():
    p = ModelConfig.from_hf(dict(PYTHIA_70M))
    assert (p.architecture, p.head_dim, p.rotary_dim, p.rope_theta, p.rms_norm_eps) == (
        "GPTNeoXForCausalLM", 64, 16, 10000.0, 1e-5)
    assert p.use_parallel_residual and p.attention_bias and p.mlp_bias
    assert not p.tie_word_embeddings and not p.lm_head_bias and p.hidden_act == "gelu"
    s = ModelConfig.from_hf(_raw("neox_sequential"))  # transformers 5's rope_parameters
    assert (s.use_parallel_residual, s.attention_bias, s.tie_word_embeddings) == (False, False, True)
    assert (s.rotary_dim, s.rope_theta, s.hidden_act) == (8, 500.0, "gelu_fast")
    bare = {k: v for k, v in PYTHIA_70M.items() if k not in (
        "architectures", "rotary_pct", "rotary_emb_base", "use_parallel_residual", "hidden_act")}
    b = ModelConfig.from_hf(bare)  # GPTNeoXConfig's defaults
    assert (b.architecture, b.rotary_dim, b.use_parallel_residual, b.hidden_act) == (
        "GPTNeoXForCausalLM", 16, True, "gelu")
    f = ModelConfig.from_hf(dict(PHI_2))
    assert (f.architecture, f.head_dim, f.rotary_dim, f.hidden_act) == (
        "PhiForCausalLM", 80, 32, "gelu_new")
    assert f.lm_head_bias and f.attention_bias and f.mlp_bias and not f.qk_norm
    q = ModelConfig.from_hf(_raw("phi_qk_gqa"))  # partial_rotary_factor in rope_parameters
    assert (q.qk_norm, q.num_key_value_heads, q.rotary_dim, q.tie_word_embeddings) == (
        True, 2, 12, True)
    bare = {k: v for k, v in PHI_2.items() if k not in (
        "architectures", "partial_rotary_factor", "hidden_act")}
    b = ModelConfig.from_hf(bare)  # PhiConfig's defaults
    assert (b.architecture, b.rotary_dim, b.hidden_act) == ("PhiForCausalLM", 40, "gelu_new")


@pytest.mark.parametrize(("raw", "edit", "message"), [
    (PYTHIA_70M, dict(rotary_pct=0.01), r"rotary_pct must be in \(0, 1\] and give an even"),
    (PYTHIA_70M, dict(rotary_pct=1.5), "rotary_pct must be in"),
    (PYTHIA_70M, dict(rotary_emb_base=0), "rotary_emb_base .* must be a positive number"),
    (PYTHIA_70M, dict(use_parallel_residual="true"), "use_parallel_residual must be true or false"),
    (PYTHIA_70M, dict(attention_bias=1), "attention_bias must be true or false, got 1"),
    (PYTHIA_70M, dict(hidden_act="relu6"), r"hidden_act 'relu6' is not supported for "
                                          r"GPTNeoXForCausalLM \(supported: gelu_pytorch_tanh"),
    (PYTHIA_70M, dict(layer_norm_eps=0), "layer_norm_eps must be a positive number, got 0"),
    (PYTHIA_70M, dict(hidden_size=500), r"hidden_size \(500\) must be num_attention_heads \(8\)"),
    (PYTHIA_70M, dict(num_key_value_heads=2), "num_key_value_heads 2 is not read for GPTNeoX"),
    (PYTHIA_70M, dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic' is not supported"),
    # fp8 / AWQ / GPTQ checkpoints are read (tests/models/test_quant_families.py); others not
    (PYTHIA_70M, dict(quantization_config={"quant_method": "bitsandbytes"}),
     "quantization_config.quant_method 'bitsandbytes' is not supported"),
    (PHI_2, dict(partial_rotary_factor=0), "partial_rotary_factor must be in"),
    (PHI_2, dict(qk_layernorm="no"), "qk_layernorm must be true or false, got 'no'"),
    (PHI_2, dict(hidden_act="gelu_10"), "hidden_act 'gelu_10' is not supported for PhiForCausalLM"),
    (PHI_2, dict(head_dim=64), r"hidden_size \(2560\) must be num_attention_heads \(32\) x head_dim 64"),
    (PHI_2, dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (PHI_2, dict(intermediate_size=None), r"missing required field\(s\): intermediate_size"),
    (PHI_2, dict(quantization_config={"quant_method": "awq", "bits": 8, "group_size": 128}),
     r"quantization_config.bits 8 is not supported \(awq checkpoints are read at 4 bits\)"),
])
def test_bad_config_is_a_clear_error(raw, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**raw, **edit})


# ----------------------------------------------------------------------------- kernels
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a power of two the Triton attention kernels take unpadded (phi_qk_gqa's
    4 query heads over its 2 KV heads)."""
    heads = 4 if name == "phi_qk_gqa" else 2
    return build_tiny(tmp_path / name, name, hidden_size=64 * heads, num_attention_heads=heads)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["neox", "phi_qk_gqa"])
def test_greedy_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend (our attention, the fused rotary + cache-write kernel on a
    partial rotary: 16 of 64 dims for NeoX, 48 for Phi; the LayerNorms and GELU stay
    torch; on the CPU in the interpreter, ~1 min each)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(1, 34, 34, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    rotary = llm.engine.model.model.layers[0].self_attn.rotary_emb
    assert rotary.fused and rotary.is_neox
    assert rotary.cos_sin_cache.shape[-1] == (16 if name == "neox" else 48)  # rotated dims
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


# Phi-2's head_dim 80 (Pythia-2.8B's too) with 32 of its dims rotated, GPT-NeoX-20B's 96
# with 24 (rotary_pct 0.25), and 80 under GQA with per-head q/k LayerNorms (60 rotated):
# heads no power of two, padded in the kernels' registers
PADDED_HEADS = {
    "phi": dict(hidden_size=160, num_attention_heads=2, partial_rotary_factor=0.4),
    "neox": dict(hidden_size=192, num_attention_heads=2, rotary_pct=0.25),
    "phi_qk_gqa": dict(hidden_size=320, num_attention_heads=4),
}
PADDED_DIMS = {"phi": (80, 32), "neox": (96, 24), "phi_qk_gqa": (80, 60)}  # head_dim, rotated


@pytest.mark.parametrize("name", sorted(PADDED_HEADS))
def test_padded_head_dim_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend at head_dim 80 (Phi, MHA and GQA) and 96 (NeoX), in the
    interpreter: our attention kernels (prompts in 16-token chunks, each after its cached
    part, then decodes beside a prompt chunk), the fused partial rotary + cache write, give
    transformers' greedy tokens."""
    path = build_tiny(tmp_path / name, name, **PADDED_HEADS[name])
    prompts = [random_prompts(1, 37, 37, seed=4)[0], random_prompts(1, 9, 9, seed=5)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=8, attention_backend="triton",
              max_num_batched_tokens=16)
    attn = llm.engine.model.model.layers[0].self_attn
    assert llm.engine.backend_name == "triton" and attn.rotary_emb.fused
    assert (attn.attn.head_dim, attn.rotary_emb.cos_sin_cache.shape[-1]) == PADDED_DIMS[name]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention and fused partial-rotary + cache-write kernels, the biased LM head's
    one-row GEMV (Phi), eager and in CUDA graphs, against transformers' fp32 tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    assert llm.engine.model.model.layers[0].self_attn.rotary_emb.fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 (triton, graphs) against transformers' fp32 tokens, teacher-forced: ours picks
    fp32's token as often as transformers' own bf16 does (conftest's
    bf16_teacher_forced_hits)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton")
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total and ours16 >= 0.85 * total, (ours16, hf16, total)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(PADDED_HEADS))
def test_gpu_padded_head_dims_default_to_triton(tmp_path, name):
    """Phi-2's head_dim 80 (and Pythia-2.8B's) and NeoX-20B's 96 run on our Triton kernels
    by default on CUDA (they fell back to torch_native before): fp32 tokens (biased LM head,
    32 of 80 / 24 of 96 dims rotated), eagerly and in CUDA graphs, are transformers'; bf16
    follows fp32 as far as transformers' bf16 does."""
    path = build_tiny(tmp_path / name, name, **PADDED_HEADS[name])
    prompts = random_prompts(4, 1, 60, seed=2)
    default = LLM(str(path), dtype="float32", device="cuda")
    assert default.engine.backend_name == "triton"
    got = [o.outputs[0].token_ids for o in default.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)
    del default
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    assert llm.engine.model.model.layers[0].self_attn.rotary_emb.fused
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton")
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total and ours16 >= 0.85 * total, (ours16, hf16, total)
