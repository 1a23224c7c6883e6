"""The ALiBi families: Bloom (models/bloom.py), MPT (models/mpt.py) and Falcon-RW (Falcon with
``alibi``: models/falcon.py), each on the attention backends' ALiBi (kernels/alibi.py).

CPU, fp32: greedy tokens and prompt logprobs equal transformers' (power-of-two and other
head counts: both slope sequences), on torch_native and on the triton backend under the
interpreter; chunked prefill, preemption and prefix hits; the biases matter (zeroed slopes
give other tokens); weights back under HF's names; ``flashpage inspect``'s parameter counts
(tiny checkpoints; bloom-560m, mpt-7b and falcon-rw-1b shapes on the meta device); config
fields and the refused ones. GPU (marked gpu): fp32 on the Triton kernels eagerly and in
CUDA graphs gives transformers' tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.attention.registry import BackendUnavailable, select_backend
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import param_counts
from flashpage.models.loader import iter_safetensors, load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    assert_dense_params_match_hf,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    cpu_greedy,
    cpu_llm,
    edited_copy,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    save_widened,
)
from tests.peft_adapter import assert_adapter_gives_merged_tokens, write_named_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

_BLOOM = dict(vocab_size=256, hidden_size=256, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
_MPT = dict(vocab_size=256, d_model=256, n_layers=2, n_heads=4, max_seq_len=512,
            bos_token_id=1, eos_token_id=2)
_FALCON_RW = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  ffn_hidden_size=512, max_position_embeddings=512, alibi=True, multi_query=False,
                  parallel_attn=False, bias=True, bos_token_id=1, eos_token_id=2)
# name -> (HF config class name, config kwargs): head_dim 64 (the Triton kernels' smallest)
TINY: dict[str, tuple[str, dict]] = {
    "bloom": ("BloomConfig", dict(_BLOOM)),
    # 6 heads: the closest power of two (4), then every other slope of the 8-head sequence;
    # an untied head
    "bloom_6h": ("BloomConfig", dict(_BLOOM, hidden_size=384, n_head=6, tie_word_embeddings=False)),
    "mpt": ("MptConfig", dict(_MPT)),
    # 6 heads (MPT's odd-then-even slopes of 8), q/k/v clamped, another softmax scale
    "mpt_6h": ("MptConfig", dict(_MPT, d_model=384, n_heads=6,
                                 attn_config=dict(clip_qkv=0.6, softmax_scale=0.2))),
    "falcon_rw": ("FalconConfig", dict(_FALCON_RW)),
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


def _slopes(llm: LLM) -> torch.Tensor:
    layer = llm.engine.model.model.layers[0]
    alibi = layer.self_attn.attn.alibi
    assert alibi is not None and layer.self_attn.rotary_emb is None
    # one tensor for every layer (the Triton backend's plans are keyed by it)
    assert all(x.self_attn.attn.alibi is alibi for x in llm.engine.model.model.layers)
    return alibi.slopes


@pytest.mark.parametrize("name", NAMES)
def test_greedy_and_prompt_logprobs_match_transformers(tiny, name):
    """Greedy tokens equal transformers'; each prompt token's logprob is transformers'
    log-softmax; the slopes are fp32."""
    path = tiny(name)
    prompts = random_prompts(2, 5, 40, seed=1)
    llm = cpu_llm(path)
    assert _slopes(llm).dtype == torch.float32
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    rows, nxt = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    lps = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(lps, logits.log_softmax(-1)[rows, nxt], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["bloom_6h", "mpt_6h", "falcon_rw"])
def test_biases_matter(tiny, name):
    """Zeroed slopes (no position information at all) give other tokens: the checks above
    see the biases."""
    path = tiny(name)
    prompts = random_prompts(2, 20, 40, seed=3)
    llm = cpu_llm(path)
    with_alibi = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    _slopes(llm).zero_()
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert with_alibi != without


@pytest.mark.parametrize("name", ["bloom_6h", "mpt_6h", "falcon_rw"])
def test_greedy_on_our_kernels_matches_transformers(tiny, name):
    """The triton backend (the interpreter on the CPU): ALiBi in the paged prefill (a prompt
    over several key tiles and blocks) and the paged decode, fp32."""
    path = tiny(name)
    prompts = random_prompts(2, 20, 36, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = cpu_llm(path, attention_backend="triton", block_size=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


@pytest.mark.parametrize("name", ["bloom", "mpt_6h"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts over several steps into a cache too small for all: chunks after cached
    prefixes, mixed decode + prefill steps, preemption, prefix hits; transformers' tokens."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


def test_mpt_biases_with_no_bias_false(tiny, tmp_path):
    """``no_bias`` false: every linear and LayerNorm of MPT has a bias, as MosaicML's code
    builds them (transformers' MPT builds none, so it is no reference here). Zero biases
    give transformers' tokens of the bias-free checkpoint (each bias found its place);
    random ones change them; inspect counts the file's parameters."""
    src = tiny("mpt")
    prompts = random_prompts(2, 10, 30, seed=4)
    truth = hf_greedy(src, prompts, GREEDY.max_tokens)

    def biases(fill):
        def add(t):
            for name in list(t):
                if name.endswith(".weight") and not name.endswith(("wte.weight", "lm_head.weight")):
                    t[name.removesuffix(".weight") + ".bias"] = fill(t[name].shape[0])
        return add

    zero = edited_copy(src, tmp_path / "zero", edit=biases(torch.zeros),
                       config_edit=lambda c: c.update(no_bias=False))
    assert cpu_greedy(zero, prompts, GREEDY) == truth
    g = torch.Generator().manual_seed(0)
    rand = edited_copy(src, tmp_path / "rand", edit=biases(lambda n: torch.randn(n, generator=g)),
                       config_edit=lambda c: c.update(no_bias=False))
    assert cpu_greedy(rand, prompts, GREEDY) != truth
    n_file = sum(t.numel() for _, t in iter_safetensors(str(rand)))
    assert param_counts(ModelConfig.from_hf(rand)) == (n_file, n_file)  # tied: no lm_head


def test_flex_backend_declines(tiny):
    cfg = ModelConfig.from_hf(tiny("bloom"))
    with pytest.raises(BackendUnavailable, match="ALiBi"):
        select_backend("flex", cfg, torch.device("cpu"), torch.float32)


# ----------------------------------------------------------------- loading, inspect


@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    path = tiny(name)
    model, ref = load_and_round_trip(path)


def test_bloom_query_key_value_rows_regrouped(tiny):
    """Our qkv_proj's q, k and v are transformers' (BloomAttention._reshape of
    query_key_value: [q k v] head by head), bias included."""
    path = tiny("bloom")
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(0))
    attn = hf.transformer.h[1].self_attention
    with torch.no_grad():
        ours = model.model.layers[1].self_attn.qkv_proj(x[0]).split(256, dim=-1)
        want = attn._reshape(attn.query_key_value(x))  # 3 x [1, heads, 5, 64]
    for got, w in zip(ours, want, strict=True):
        torch.testing.assert_close(got, w[0].transpose(0, 1).reshape(5, 256), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


# config.json as published (bigscience/bloom-560m, mosaicml/mpt-7b, tiiuae/falcon-rw-1b)
BLOOM_560M = dict(architectures=["BloomForCausalLM"], apply_residual_connection_post_layernorm=False,
                  bos_token_id=1, eos_token_id=2, hidden_size=1024, layer_norm_epsilon=1e-05,
                  model_type="bloom", n_head=16, n_inner=None, n_layer=24, pretraining_tp=1,
                  slow_but_exact=False, vocab_size=250880)
MPT_7B = dict(architectures=["MPTForCausalLM"], attn_config=dict(
    alibi=True, alibi_bias_max=8, attn_impl="torch", attn_pdrop=0, attn_type="multihead_attention",
    attn_uses_sequence_id=False, clip_qkv=None, prefix_lm=False, qk_ln=False, softmax_scale=None),
    d_model=4096, expansion_ratio=4, learned_pos_emb=True, logit_scale=None, max_seq_len=2048,
    model_type="mpt", n_heads=32, n_layers=32, no_bias=True, vocab_size=50432)
FALCON_RW_1B = dict(architectures=["FalconForCausalLM"], alibi=True, bias=True, bos_token_id=1,
                    eos_token_id=2, hidden_size=2048, layer_norm_epsilon=1e-05, model_type="falcon",
                    multi_query=False, new_decoder_architecture=False, num_attention_heads=32,
                    num_hidden_layers=24, parallel_attn=False, vocab_size=50304)


@pytest.mark.parametrize("raw", [BLOOM_560M, MPT_7B, FALCON_RW_1B],
                         ids=["bloom-560m", "mpt-7b", "falcon-rw-1b"])
def test_inspect_counts_real_shapes(raw):
    """Parameters as transformers builds them (meta device): 559M, 6.65B, 1.31B."""
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    total, active = param_counts(ModelConfig.from_hf(dict(raw)))
    assert total == active == hf.num_parameters()


def test_config_fields():
    b = ModelConfig.from_hf(dict(BLOOM_560M))
    assert (b.architecture, b.head_dim, b.num_key_value_heads, b.intermediate_size) == (
        "BloomForCausalLM", 64, 16, 4096)
    assert b.alibi and b.alibi_bias_max is None and not b.uses_rope(0)
    assert b.attention_bias and b.mlp_bias and b.tie_word_embeddings and b.hidden_act == "gelu_new"
    old = {k: v for k, v in BLOOM_560M.items() if k != "hidden_size"} | {"n_embed": 1024}
    assert ModelConfig.from_hf(old).hidden_size == 1024  # BloomConfig's old n_embed
    m = ModelConfig.from_hf(dict(MPT_7B))  # the file's MPTForCausalLM: by model_type
    assert (m.architecture, m.hidden_size, m.num_hidden_layers, m.head_dim) == (
        "MptForCausalLM", 4096, 32, 128)
    assert (m.intermediate_size, m.max_position_embeddings, m.alibi_bias_max) == (16384, 2048, 8.0)
    assert m.alibi and not m.attention_bias and not m.mlp_bias and m.hidden_act == "gelu"
    assert m.clip_qkv is None and m.attention_multiplier is None and m.logit_scale == 1.0
    tuned = ModelConfig.from_hf({**MPT_7B, "logit_scale": "inv_sqrt_d_model", "attn_config": {
        **MPT_7B["attn_config"], "clip_qkv": 8, "softmax_scale": 0.1, "alibi_bias_max": 16}})
    assert (tuned.logit_scale, tuned.clip_qkv, tuned.attention_multiplier, tuned.alibi_bias_max) == (
        4096 ** -0.5, 8.0, 0.1, 16.0)
    bare = ModelConfig.from_hf(dict(model_type="mpt"))  # MptConfig's defaults
    assert (bare.hidden_size, bare.num_attention_heads, bare.vocab_size) == (2048, 16, 50368)
    f = ModelConfig.from_hf(dict(FALCON_RW_1B))
    assert f.alibi and not f.uses_rope(0) and f.num_key_value_heads == 32
    assert not f.use_parallel_residual and f.attention_bias


def _raw_mpt(**attn) -> dict:
    return {**MPT_7B, "attn_config": {**MPT_7B["attn_config"], **attn}}


@pytest.mark.parametrize(("raw", "message"), [
    ({**BLOOM_560M, "apply_residual_connection_post_layernorm": True},
     "apply_residual_connection_post_layernorm true is not supported for BloomForCausalLM"),
    ({**BLOOM_560M, "n_head": 7}, r"hidden_size \(1024\) must be num_attention_heads \(7\)"),
    ({**BLOOM_560M, "quantization_config": {"quant_method": "fp8"}},
     "quantization_config .* is not read for BloomForCausalLM"),
    (_raw_mpt(prefix_lm=True), r"attn_config.prefix_lm true is not supported for MptForCausalLM"),
    (_raw_mpt(attn_uses_sequence_id=True), "attn_config.attn_uses_sequence_id true is not supported"),
    (_raw_mpt(qk_ln=True), "attn_config.qk_ln true is not supported"),
    (_raw_mpt(alibi=False), "attn_config.alibi false is not supported for MptForCausalLM"),
    (_raw_mpt(attn_type="multiquery_attention"),
     "attn_config.attn_type 'multiquery_attention' is not supported"),
    (_raw_mpt(clip_qkv=-1), "clip_qkv must be a positive number"),
    (_raw_mpt(alibi_bias_max=0), "alibi_bias_max must be a positive number"),
    ({**MPT_7B, "attn_config": "torch"}, "attn_config must be an object or null"),
    ({**MPT_7B, "expansion_ratio": 2}, "expansion_ratio 2 is not supported for MptForCausalLM"),
    ({**MPT_7B, "logit_scale": "big"}, "logit_scale must be a positive number"),
])
def test_bad_config_is_a_clear_error(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tiny, name):
    """ALiBi in our attention kernels, eagerly and in CUDA graphs (the slopes read at one
    address), against transformers' fp32 tokens."""
    llm = assert_gpu_graphs_match_hf(tiny(name), random_prompts(8, 1, 120, seed=28))
    assert _slopes(llm).is_cuda


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_slopes_stay_fp32(tiny):
    """A bf16 model keeps its slopes fp32 (KeepFp32) and runs; tokens start as fp32's."""
    path = tiny("bloom")
    llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton")
    assert _slopes(llm).dtype == torch.float32
    prompts = random_prompts(4, 10, 60, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    truth = hf_greedy(path, prompts, 2)
    assert sum(g[0] == t[0] for g, t in zip(got, truth, strict=True)) >= 3


LORA_MODULES = {  # PEFT's default targets for these families first: their fused q/k/v linear
    "bloom": ("transformer.h", {"self_attention.query_key_value": (256, 768),
                                "self_attention.dense": (256, 256),
                                "mlp.dense_h_to_4h": (256, 1024), "mlp.dense_4h_to_h": (1024, 256)}),
    "mpt": ("transformer.blocks", {"attn.Wqkv": (256, 768), "attn.out_proj": (256, 256),
                                   "ffn.up_proj": (256, 1024), "ffn.down_proj": (1024, 256)}),
}


@pytest.mark.parametrize("name", sorted(LORA_MODULES))
def test_lora_adapter_on_the_fused_qkv_gives_the_merged_checkpoints_tokens(tiny, tmp_path, name):
    """A PEFT adapter on Bloom's query_key_value (per-head [q k v] rows: lora_B regrouped
    as the weight is) or MPT's Wqkv, and the other linears, under the family's names:
    transformers' tokens of the checkpoint with it merged."""
    prefix, modules = LORA_MODULES[name]
    adapter = write_named_adapter(tmp_path / "adapter", {
        f"{prefix}.{layer}.{module}": shape for layer in range(2) for module, shape in modules.items()},
        std=0.05)
    assert_adapter_gives_merged_tokens(tiny(name), adapter, tmp_path, n_prompts=2)
