"""GPT-J (one LayerNorm feeding attention and MLP in parallel, bias-free q/k/v/out_proj,
rotary on the first rotary_dim dims in interleaved pairs, an LM head with a bias) and
Falcon (its three layer forms, the fused query_key_value per KV group for MHA, MQA and
GQA, optional biases, a tied head): models/gptj.py, falcon.py, on Llama's attention and
loading under their names.

CPU, fp32: greedy tokens and prompt logprobs equal transformers' for each form; chunked
prefill, preemption and prefix hits; query_key_value's rows regrouped into our q, k, v as
transformers splits them; weights back under HF's names, LoRA targets under them; a
missing or misshapen tensor named as the checkpoint names it; ``flashpage inspect``'s
parameter counts (tiny checkpoints; GPT-J-6B, Falcon-7B and Falcon-40B shapes against
transformers on the meta device) and KV bytes; config fields and errors.
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens,
and bf16 follows fp32 about as far as transformers' bf16 does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import inspect_config, param_counts
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import (
    _checkpoints,
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
    save_widened,
)
from tests.peft_adapter import assert_adapter_gives_merged_tokens, write_named_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

# name -> (HF config class name, config kwargs); 2 layers, hidden 64, 4 heads of 16
_GPTJ = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512,
             bos_token_id=1, eos_token_id=2)
_FALCON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               ffn_hidden_size=128, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
TINY: dict[str, tuple[str, dict]] = {
    # GPT-J-6B's shape: a quarter of each head rotated (8 of 16 dims, interleaved), gelu_new
    "gptj": ("GPTJConfig", dict(_GPTJ, rotary_dim=8)),
    # the whole head rotated, the head tied to wte (its bias not), exact GELU
    "gptj_tied": ("GPTJConfig", dict(_GPTJ, rotary_dim=16, tie_word_embeddings=True,
                                     activation_function="gelu")),
    # Falcon-7B: MQA (one KV head), one norm feeding both branches, no bias, tied head
    "falcon_7b": ("FalconConfig", dict(_FALCON)),
    # Falcon-40B/180B: 2 KV groups of 2 query heads, ln_attn + ln_mlp, biases, untied, theta 500
    "falcon_40b": ("FalconConfig", dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2,
                                        bias=True, tie_word_embeddings=False,
                                        rope_parameters=dict(rope_type="default",
                                                             rope_theta=500.0))),
    # Falcon2-11B: the new architecture with one norm (num_ln_in_parallel_attn 1), 1 KV group
    "falcon_11b": ("FalconConfig", dict(_FALCON, new_decoder_architecture=True, num_kv_heads=1,
                                        num_ln_in_parallel_attn=1)),
    # parallel_attn false (sequential), every head its own k and v, biases
    "falcon_seq": ("FalconConfig", dict(_FALCON, multi_query=False, parallel_attn=False,
                                        bias=True)),
}
NAMES = sorted(TINY)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint, its weights widened so logits are far from ties (LayerNorm
    weights in [0.5, 1.5], everything else N(0, 0.2))."""
    cls_name, kwargs = TINY[name]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    return save_widened(config, path, seed, lambda n: ".ln_" in n or "norm" in n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_and_prompt_logprobs_match_transformers(tiny, name):
    """Greedy tokens equal transformers'; each prompt token's logprob is transformers'
    log-softmax (GPT-J's without its LM-head bias would be others)."""
    path = tiny(name)
    prompts = random_prompts(2, 5, 30, seed=1)
    llm = cpu_llm(path)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)
    prompt = random_prompts(1, 30, 30, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    rows, nxt = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    lps = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(lps, logits.log_softmax(-1)[rows, nxt], atol=1e-4, rtol=1e-4)
    if name.startswith("gptj"):
        unbiased = (logits - hf.lm_head.bias).log_softmax(-1)[rows, nxt]
        assert not torch.allclose(lps, unbiased, atol=1e-2)


def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny):
    """Falcon-40B's form (GQA from per-group rows, two norms, biases): 10 prompts over
    several steps into a cache too small for all; transformers' tokens."""
    assert_staggered_matches_hf(tiny("falcon_40b"), attention_backend="torch_native")


@pytest.mark.parametrize("name", ["falcon_7b", "falcon_40b", "falcon_seq"])
def test_query_key_value_rows_regrouped(tiny, name, monkeypatch):
    """Our qkv_proj's q, k and v for an input are those transformers' FalconAttention splits
    query_key_value into (q and k as they enter its rotary, v as it enters attention), bias
    included. Where transformers broadcasts the new architecture's k and v to every query
    head of their group (before 5.25), each group's first copy is compared."""
    from transformers.models.falcon import modeling_falcon

    path = tiny(name)
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    c = model.config
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    seen: dict[str, torch.Tensor] = {}
    rotary, eager = modeling_falcon.apply_rotary_pos_emb, modeling_falcon.eager_attention_forward

    def capture_rotary(q, k, *args, **kwargs):
        seen.setdefault("q", q)
        seen.setdefault("k", k)
        return rotary(q, k, *args, **kwargs)

    def capture_attention(module, q, k, v, *args, **kwargs):
        seen.setdefault("v", v)
        return eager(module, q, k, v, *args, **kwargs)

    monkeypatch.setattr(modeling_falcon, "apply_rotary_pos_emb", capture_rotary)
    monkeypatch.setattr(modeling_falcon, "eager_attention_forward", capture_attention)
    attn = hf.transformer.h[1].self_attention
    with torch.no_grad():
        q, k, v = model.model.layers[1].self_attn.qkv_proj(x[0]).split(
            [64, 16 * c.num_key_value_heads, 16 * c.num_key_value_heads], dim=-1)
        if hasattr(attn, "_split_heads"):  # transformers < 5.25: [1, 5, heads, 16] each
            want = attn._split_heads(attn.query_key_value(x))
        else:  # [1, heads, 5, 16] each, from its forward
            pos = torch.arange(5)[None]
            attn(x, attention_mask=None, position_ids=pos, position_embeddings=hf.transformer.rotary_emb(x, pos))
            want = tuple(seen[n].transpose(1, 2) for n in "qkv")
    torch.testing.assert_close(q, want[0].reshape(5, 64), atol=1e-6, rtol=1e-6)
    for got, w in zip((k, v), want[1:], strict=True):
        group = w.shape[2] // c.num_key_value_heads  # transformers' copies of each KV head
        torch.testing.assert_close(got, w[0, :, ::group].reshape(5, -1), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------- loading, inspect
LORA = {
    "gptj": {"transformer.h.1.attn.k_proj": ("model.layers.1.self_attn.qkv_proj", 64, 64),
             "transformer.h.1.attn.out_proj": ("model.layers.1.self_attn.o_proj", 0, 64),
             "transformer.h.1.mlp.fc_in": ("model.layers.1.mlp.c_fc", 0, 128),
             "transformer.h.1.mlp.fc_out": ("model.layers.1.mlp.c_proj", 0, 64)},
    "falcon_40b": {"transformer.h.1.self_attention.dense": ("model.layers.1.self_attn.o_proj", 0, 64),
                   "transformer.h.1.mlp.dense_h_to_4h": ("model.layers.1.mlp.c_fc", 0, 128),
                   "transformer.h.1.mlp.dense_4h_to_h": ("model.layers.1.mlp.c_proj", 0, 64)},
}


@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    path = tiny(name)
    model, ref = load_and_round_trip(path)
    if name.startswith("gptj"):
        assert "lm_head.bias" in ref
    if name in LORA:
        targets = model.lora_targets()
        assert LORA[name].items() <= targets.items()
        assert len(targets) == 2 * (6 if name == "gptj" else 4)  # query_key_value whole


def test_gptj_mask_buffers_are_skipped(tiny, tmp_path):
    """EleutherAI's GPT-J files hold attn.bias and attn.masked_bias (causal-mask buffers):
    read past, as transformers does."""

    def add(t):
        t["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
        t["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e9)

    path = edited_copy(tiny("gptj"), tmp_path / "with_buffers", edit=add)
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    assert "transformer.h.0.attn.bias" not in dict(model.hf_weights())


# name -> the HF modules a LoRA adapter adapts (in both layers), in_features, out_features
LORA_MODULES = {
    "gptj": {"attn.q_proj": (64, 64), "attn.v_proj": (64, 64), "attn.out_proj": (64, 64),
             "mlp.fc_in": (64, 128), "mlp.fc_out": (128, 64)},
    # query_key_value: 4 q heads and 2 KV groups' k and v, 16 wide
    "falcon_40b": {"self_attention.query_key_value": (64, 128), "self_attention.dense": (64, 64),
                   "mlp.dense_h_to_4h": (64, 128), "mlp.dense_4h_to_h": (128, 64)},
}


@pytest.mark.parametrize("name", sorted(LORA_MODULES))
def test_lora_adapter_under_hf_names_gives_the_merged_checkpoints_tokens(tiny, tmp_path, name):
    """A PEFT adapter naming the family's own modules (transformer.h.N.attn.q_proj,
    transformer.h.N.mlp.dense_h_to_4h ...) gives transformers' tokens of the checkpoint
    with it merged."""
    adapter = write_named_adapter(tmp_path / "adapter", {
        f"transformer.h.{layer}.{module}": shape for layer in range(2)
        for module, shape in LORA_MODULES[name].items()})
    assert_adapter_gives_merged_tokens(tiny(name), adapter, tmp_path, n_prompts=2)


@pytest.mark.parametrize(("name", "dropped"), [
    ("gptj", "transformer.h.1.attn.v_proj.weight"),
    ("gptj", "lm_head.bias"),
    ("falcon_40b", "transformer.h.0.ln_mlp.bias"),
    ("falcon_40b", "transformer.h.1.self_attention.query_key_value.weight"),
    ("falcon_seq", "transformer.h.0.post_attention_layernorm.weight"),
])
def test_missing_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path, name, dropped):
    assert_missing_tensor_named(tiny(name), tmp_path, dropped)


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("gptj", lambda t: t.update({"transformer.h.0.attn.extra.weight": torch.ones(2)}),
     "checkpoint tensor 'transformer.h.0.attn.extra.weight' has no place"),
    ("gptj", lambda t: t.update({"transformer.h.1.mlp.fc_out.bias": torch.ones(3)}),
     r"transformer.h.1.mlp.fc_out.bias: checkpoint shape \(3,\) != \(64,\)"),
    ("falcon_40b", lambda t: t.update(
        {"transformer.h.0.self_attention.query_key_value.bias": torch.ones(96)}),
     r"query_key_value.bias: checkpoint shape \(96,\) does not have \(4 query \+ 2 x 2 KV "
     r"heads\) x 16 = 128 rows"),
    ("falcon_7b", lambda t: t.update({"transformer.h.0.ln_attn.weight": torch.ones(64)}),
     "checkpoint tensor 'transformer.h.0.ln_attn.weight' has no place"),
])
def test_bad_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path, name, edit, message):
    assert_edit_refused(tiny(name), tmp_path, edit, message)


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


# config.json as published (EleutherAI/gpt-j-6b, tiiuae/falcon-7b, tiiuae/falcon-40b)
GPTJ_6B = dict(architectures=["GPTJForCausalLM"], activation_function="gelu_new",
               bos_token_id=50256, eos_token_id=50256, layer_norm_epsilon=1e-05,
               model_type="gptj", n_embd=4096, n_head=16, n_inner=None, n_layer=28,
               n_positions=2048, rotary_dim=64, tie_word_embeddings=False,
               torch_dtype="float32", vocab_size=50400)
FALCON_7B = dict(architectures=["FalconForCausalLM"], alibi=False, bias=False, bos_token_id=11,
                 eos_token_id=11, hidden_size=4544, layer_norm_epsilon=1e-05,
                 model_type="falcon", multi_query=True, new_decoder_architecture=False,
                 num_attention_heads=71, num_hidden_layers=32, parallel_attn=True,
                 torch_dtype="bfloat16", vocab_size=65024)
FALCON_40B = dict(FALCON_7B, hidden_size=8192, num_attention_heads=128, num_hidden_layers=60,
                  num_kv_heads=8, new_decoder_architecture=True)


@pytest.mark.parametrize("raw", [GPTJ_6B, FALCON_7B, FALCON_40B],
                         ids=["gpt-j-6b", "falcon-7b", "falcon-40b"])
def test_inspect_counts_real_shapes(raw):
    """GPT-J-6B's, Falcon-7B's and Falcon-40B's parameters as transformers builds them (meta
    device): 6.05B, 6.92B, 41.8B; and their KV bytes a token (bf16): one KV head of 64 for
    Falcon-7B, 8 for 40B, 16 of 256 for GPT-J."""
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    ours = ModelConfig.from_hf(dict(raw))
    total, active = param_counts(ours)
    assert total == active == hf.num_parameters()
    kv_heads = {"gptj": 16, "falcon": 8 if raw.get("num_kv_heads") else 1}[raw["model_type"]]
    head_dim = 256 if raw["model_type"] == "gptj" else 64
    info = inspect_config(ours, 80 * 2**30)
    assert info["kv_bytes_per_token"] == 2 * kv_heads * head_dim * 2 * ours.num_hidden_layers


def _raw(name: str, **edit) -> dict:
    cls_name, kwargs = TINY[name]
    d = getattr(transformers, cls_name)(**kwargs).to_dict()
    d["architectures"] = [cls_name.replace("Config", "ForCausalLM")]
    d.update(edit)
    return d


def test_config_fields():
    j = ModelConfig.from_hf(dict(GPTJ_6B))
    assert (j.architecture, j.head_dim, j.rotary_dim, j.intermediate_size, j.rope_theta) == (
        "GPTJForCausalLM", 256, 64, 16384, 10000.0)
    assert j.rope_interleaved and j.lm_head_bias and j.mlp_bias and not j.attention_bias
    assert (j.num_key_value_heads, j.hidden_act, j.tie_word_embeddings) == (16, "gelu_new", False)
    odd = ModelConfig.from_hf({**GPTJ_6B, "n_embd": 44 * 16, "rotary_dim": 30})
    assert (odd.head_dim, odd.rotary_dim) == (44, 30)  # int(44 * (30 / 44)) would be 29
    f7 = ModelConfig.from_hf(dict(FALCON_7B))
    assert (f7.head_dim, f7.num_key_value_heads, f7.intermediate_size) == (64, 1, 4 * 4544)
    assert f7.use_parallel_residual and f7.parallel_norms == 1 and f7.tie_word_embeddings
    assert not f7.attention_bias and not f7.mlp_bias and not f7.rope_interleaved
    f40 = ModelConfig.from_hf(dict(FALCON_40B))
    assert (f40.num_key_value_heads, f40.parallel_norms, f40.rotary_dim) == (8, 2, 64)
    f40b = ModelConfig.from_hf(_raw("falcon_40b"))  # transformers 5's rope_parameters
    assert (f40b.rope_theta, f40b.attention_bias, f40b.tie_word_embeddings) == (500.0, True, False)
    s = ModelConfig.from_hf(_raw("falcon_seq"))
    assert (s.use_parallel_residual, s.num_key_value_heads, s.mlp_bias) == (False, 4, True)
    old = {k: v for k, v in FALCON_7B.items() if k != "hidden_size"} | {"n_embed": 4544}
    assert ModelConfig.from_hf(old).hidden_size == 4544  # FalconConfig's old n_embed
    bare = dict(model_type="falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4)
    b = ModelConfig.from_hf(bare)  # FalconConfig's defaults: the 7B form
    assert (b.architecture, b.num_key_value_heads, b.parallel_norms, b.hidden_act) == (
        "FalconForCausalLM", 1, 1, "gelu")


@pytest.mark.parametrize(("raw", "edit", "message"), [
    (FALCON_7B, dict(alibi="yes"), "alibi must be true or false"),
    (FALCON_40B, dict(parallel_attn=False), "parallel_attn false is not supported with "
                                            "new_decoder_architecture true"),
    (FALCON_7B, dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn 2 needs "
                                                 "new_decoder_architecture true"),
    (FALCON_7B, dict(num_ln_in_parallel_attn=3), "num_ln_in_parallel_attn must be 1, 2 or null"),
    (FALCON_40B, dict(num_kv_heads=3), r"num_kv_heads must be a positive divisor of "
                                       r"num_attention_heads \(128\)"),
    (FALCON_7B, dict(multi_query=False, num_kv_heads=1), "num_kv_heads 1 is not supported with "
                                                         "multi_query false"),
    (FALCON_7B, dict(multi_query="yes"), "multi_query must be true or false"),
    (FALCON_7B, dict(activation="relu6"), "activation 'relu6' is not supported for Falcon"),
    (FALCON_7B, dict(ffn_hidden_size=0), "ffn_hidden_size must be a positive integer"),
    (FALCON_7B, dict(hidden_size=4545), r"hidden_size \(4545\) must be num_attention_heads"),
    (FALCON_7B, dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic' is not supported"),
    (GPTJ_6B, dict(rotary_dim=None), r"rotary_dim must be an even integer from 2 to head_dim "
                                     r"\(256\) for GPTJForCausalLM, got None"),
    (GPTJ_6B, dict(rotary_dim=63), "rotary_dim must be an even integer"),
    (GPTJ_6B, dict(rotary_dim=512), "rotary_dim must be an even integer"),
    (GPTJ_6B, dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling is not read for GPTJForCausalLM: its rotary has base 10000"),
    (GPTJ_6B, dict(activation_function="relu6"),
     "activation_function 'relu6' is not supported for GPTJForCausalLM"),
    (GPTJ_6B, dict(layer_norm_epsilon=-1), "layer_norm_epsilon must be a positive number"),
    (GPTJ_6B, dict(n_embd=4001), r"n_embd \(4001\) is not a multiple of n_head \(16\)"),
])
def test_bad_config_is_a_clear_error(raw, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**raw, **edit})


# ----------------------------------------------------------------------------- kernels
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a Triton attention tile unpadded; 4 query heads (GPT-J:
    16 of 64 dims rotated)."""
    if name.startswith("gptj"):
        return build_tiny(tmp_path / name, name, n_embd=256,
                          rotary_dim=16 if name == "gptj" else 64)
    return build_tiny(tmp_path / name, name, hidden_size=256)


@pytest.mark.slow
def test_gptj_greedy_on_our_kernels_matches_transformers(tmp_path):
    """The triton backend: our attention and the fused rotary + cache-write kernel on
    GPT-J's interleaved pairs over the first 16 of 64 dims (a partial rotary on pairs, which
    no other family has; on the CPU in the interpreter, ~10 s)."""
    path = _gpu_checkpoint(tmp_path, "gptj")
    prompts = random_prompts(1, 34, 34, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    rotary = llm.engine.model.model.layers[0].self_attn.rotary_emb
    assert rotary.fused and not rotary.is_neox
    assert rotary.cos_sin_cache.shape[-1] == 16  # the rotated dims
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention (MQA / GQA / MHA from regrouped rows) and fused rotary + cache-write
    kernels (GPT-J's interleaved partial rotary), the LayerNorm kernel, the biased LM head
    (GPT-J), eager and in CUDA graphs, against transformers' fp32 tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    rotary = llm.engine.model.model.layers[0].self_attn.rotary_emb
    assert rotary.fused and rotary.is_neox == name.startswith("falcon")


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
def test_gpu_gptj_head_dim_256(tmp_path):
    """GPT-J-6B's head_dim 256 (64 dims rotated, interleaved) on the triton backend: fp32
    tokens are transformers'."""
    path = build_tiny(tmp_path / "gptj256", "gptj", n_embd=512, n_head=2, rotary_dim=64)
    prompts = random_prompts(4, 1, 60, seed=2)
    llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="triton")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)
