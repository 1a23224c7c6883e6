"""Cohere2 (Command R7B / Command A: Cohere's body, with sliding-window layers that rotate
and full-attention layers with no positional embedding at all, NoPE) and OLMo (1)
(Llama's body with weightless LayerNorms and clip_qkv): models/cohere.py, models/olmo.py.

CPU, fp32: greedy tokens equal transformers' for each family, on prompts past Cohere2's
window, over configs holding both of its layer kinds; the window, NoPE and clip_qkv each
shown to change the tokens; prompt logprobs equal transformers' log-softmax; chunked
prefill / preemption / prefix hits; the weightless LayerNorm against transformers'
OlmoLayerNorm; weights back under HF's names; ``flashpage inspect``'s parameter counts
and rows; config fields (layer types from ``sliding_window_pattern`` as transformers
derives them) and errors.
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
from flashpage.inspect import param_counts
from flashpage.layers.norm import LayerNorm
from flashpage.layers.rotary import get_rope
from tests.conftest import (
    _checkpoints,
    assert_dense_params_match_hf,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    cpu_greedy,
    cpu_llm,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    tiny_table_builder,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
WINDOW = 16  # Cohere2's sliding_window: the prompts run past it
SLIDE, FULL = "sliding_attention", "full_attention"

# name -> (HF config class name, extra config kwargs); hidden 64, 4 heads
TINY: dict[str, tuple[str, dict]] = {
    # a sliding (rotary) layer, then a full-attention (NoPE) one; GQA, tied head, logits x 1/4
    "cohere2": ("Cohere2Config", dict(num_hidden_layers=2, num_key_value_heads=2,
                                      layer_types=[SLIDE, FULL], sliding_window=WINDOW,
                                      logit_scale=0.25)),
    # Command R7B's layout from sliding_window_pattern 4 (3 sliding, 1 full), with biases
    # (o_proj's too), an untied head, its own eps, a shorter window
    "cohere2_pattern": ("Cohere2Config", dict(num_hidden_layers=4, num_key_value_heads=4,
                                              sliding_window_pattern=4, sliding_window=8,
                                              attention_bias=True, tie_word_embeddings=False,
                                              layer_norm_eps=1e-3, logit_scale=0.5)),
    # q/k/v clipped well inside their spread (~1.6 here); tied head, GQA
    "olmo": ("OlmoConfig", dict(num_hidden_layers=2, num_key_value_heads=2, clip_qkv=1.0,
                                tie_word_embeddings=True)),
    # no clipping, attention_bias, an untied head
    "olmo_plain": ("OlmoConfig", dict(num_hidden_layers=2, num_key_value_heads=4,
                                      attention_bias=True)),
}
NAMES = sorted(TINY)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


build_tiny = tiny_table_builder(TINY)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _prompts() -> list[list[int]]:
    return random_prompts(3, WINDOW + 4, 40, seed=1)  # past both Cohere2 windows


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    assert cpu_greedy(path, _prompts()) == hf_greedy(path, _prompts(), GREEDY.max_tokens)


def test_cohere2_layers_rotate_and_window_by_kind(tiny):
    """Sliding layers: a window and a rotary; full-attention layers: neither (NoPE)."""
    llm = cpu_llm(tiny("cohere2_pattern"))
    layers = llm.engine.model.model.layers
    assert [lay.self_attn.attn.sliding_window for lay in layers] == [8, 8, 8, None]
    assert [lay.self_attn.rotary_emb is not None for lay in layers] == [True, True, True, False]
    assert not layers[0].self_attn.rotary_emb.is_neox  # Cohere's interleaved pairs


def test_cohere2_window_nope_and_clip_each_change_the_tokens(tiny):
    """Each difference matters on these prompts: without the window, with rotary on the
    full-attention layer, or without OLMo's clip_qkv the tokens are others (and ours
    equal transformers', test_greedy_matches_transformers)."""
    path, prompts = tiny("cohere2"), _prompts()
    ours = cpu_greedy(path, prompts)
    assert ours != cpu_greedy(path, prompts, hf_overrides={"sliding_window": 512})
    llm = cpu_llm(path)
    full = llm.engine.model.model.layers[1].self_attn
    assert full.rotary_emb is None
    full.rotary_emb = get_rope(llm.engine.model.config, 512, 0)  # rotate it as the sliding one
    roped = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert roped != ours
    olmo = tiny("olmo")
    assert cpu_greedy(olmo, prompts) != cpu_greedy(olmo, prompts, hf_overrides={"clip_qkv": None})


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves, not only their argmax: each prompt token's logprob is
    transformers' log-softmax (Cohere2's logit_scale in them)."""
    path = tiny(name)
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = cpu_llm(path).generate([prompt], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    want = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["cohere2", "olmo"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens
    (Cohere2's window and unrotated cached keys, OLMo's clipped ones, over chunks)."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cohere2", "olmo"])
def test_greedy_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend (our windowed and full attention, the fused rotary + cache-write
    kernel on Cohere2's sliding layers and the plain cache write on its NoPE ones; on the
    CPU in the interpreter, ~1 min each)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(1, 34, 34, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    assert llm.engine.model.model.layers[0].self_attn.rotary_emb.fused
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


# ----------------------------------------------------------------- layers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weightless_layer_norm_matches_transformers(dtype):
    """LayerNorm(elementwise_affine=False) is OlmoLayerNorm: no parameters, computed in
    fp32 and rounded once; the residual form adds first and returns the sum."""
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 3 + 1).to(dtype)
    r = torch.randn(5, 64, generator=g).to(dtype)
    ours, hf = LayerNorm(64, 1e-5, elementwise_affine=False), OlmoLayerNorm(64)
    assert list(ours.parameters()) == [] and ours.weight is None and ours.bias is None
    assert torch.equal(ours(x), hf(x))
    normed, summed = ours(x, r)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, hf(x + r))


# ----------------------------------------------------------------- loading, inspect
@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    path = tiny(name)
    model, ref = load_and_round_trip(path)
    if name.startswith("olmo"):  # weightless norms: nothing of them in the checkpoint
        assert not any("norm" in n for n in ref)


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


@pytest.mark.parametrize(("cls_name", "kw"), [
    ("Cohere2Config", dict(  # Command R7B's config.json
        vocab_size=256000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, sliding_window=4096,
        sliding_window_pattern=4, rope_theta=50000.0, logit_scale=0.25,
        max_position_embeddings=132096)),
    ("OlmoConfig", dict(  # OLMo-7B-0724-hf's
        vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, max_position_embeddings=4096, tie_word_embeddings=False)),
])
def test_inspect_counts_full_size_models(cls_name, kw):
    """The released shapes, against transformers' model built on the meta device."""
    from flashpage.inspect import format_report, inspect_config

    hf_cfg = getattr(transformers, cls_name)(**kw)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    arch = cls_name.replace("Config", "ForCausalLM")
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [arch]})
    assert param_counts(cfg) == (hf.num_parameters(),) * 2
    report = format_report(inspect_config(cfg, 80 * 2**30))
    if arch == "Cohere2ForCausalLM":
        assert hf.num_parameters() == 8_028_033_024
        assert "none on 8 of 32 layers (NoPE)" in report
        assert "4096 on 24 of 32 layers" in report


def test_inspect_reports_windows_and_nope_layers(tiny, capsys):
    from flashpage.inspect import main

    assert main([str(tiny("cohere2_pattern"))]) == 0
    out = capsys.readouterr().out
    assert "Cohere2ForCausalLM (cohere2)" in out
    assert ("all dims, interleaved pairs (GPT-J's layout); none on 1 of 4 layers "
            "(NoPE)") in out
    assert "8 on 3 of 4 layers" in out
    assert main([str(tiny("olmo"))]) == 0
    out = capsys.readouterr().out
    assert "OlmoForCausalLM (olmo)" in out and "rotary" not in out and "NoPE" not in out


# ----------------------------------------------------------------- config
def _raw(name: str, **edit) -> dict:
    cls_name, extra = TINY[name]
    d = getattr(transformers, cls_name)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=512, **extra).to_dict()
    d["architectures"] = [cls_name.replace("Config", "ForCausalLM")]
    d.update(edit)
    return d


@pytest.mark.parametrize(("layers", "pattern"), [(6, 4), (5, 2), (3, 1), (4, None)])
def test_cohere2_layer_types_from_the_pattern_as_transformers(layers, pattern):
    """Older configs carry sliding_window_pattern (default 4) instead of layer_types:
    each layer's kind, window and rotary follow transformers' derivation."""
    kw = {} if pattern is None else {"sliding_window_pattern": pattern}
    hf = transformers.Cohere2Config(num_hidden_layers=layers, sliding_window=32, **kw)
    raw = {**_raw("cohere2", num_hidden_layers=layers, sliding_window=32), **kw}
    del raw["layer_types"]
    c = ModelConfig.from_hf(raw)
    assert list(c.layer_types) == hf.layer_types
    assert [c.attention_window(i) for i in range(layers)] == [
        32 if t == SLIDE else None for t in hf.layer_types]
    assert [c.uses_rope(i) for i in range(layers)] == [t == SLIDE for t in hf.layer_types]


def test_config_fields():
    c = ModelConfig.from_hf(_raw("cohere2"))
    assert (c.architecture, c.sliding_window, c.layer_types, c.logit_scale) == (
        "Cohere2ForCausalLM", WINDOW, (SLIDE, FULL), 0.25)
    assert c.rope_interleaved and c.tie_word_embeddings and not c.qk_norm
    # Cohere2Config's defaults where config.json says nothing: a 4096 window, 1/16, tied
    bare = {k: v for k, v in _raw("cohere2").items() if k not in (
        "architectures", "sliding_window", "logit_scale", "tie_word_embeddings")}
    c = ModelConfig.from_hf(bare)
    assert (c.architecture, c.sliding_window, c.logit_scale, c.tie_word_embeddings) == (
        "Cohere2ForCausalLM", 4096, 0.0625, True)
    # Cohere (1) and every other family rotate every layer
    assert ModelConfig.from_hf(_raw("cohere2", architectures=["CohereForCausalLM"],
                                    model_type="cohere")).uses_rope(1)
    o = ModelConfig.from_hf(_raw("olmo"))
    assert (o.architecture, o.clip_qkv, o.rms_norm_eps, o.tie_word_embeddings) == (
        "OlmoForCausalLM", 1.0, 1e-5, True)
    p = ModelConfig.from_hf(_raw("olmo_plain", rms_norm_eps=1e-6))  # OLMo's eps is fixed
    assert (p.clip_qkv, p.rms_norm_eps, p.tie_word_embeddings, p.attention_bias) == (
        None, 1e-5, False, True)
    assert all(p.uses_rope(i) for i in range(2)) and p.layer_types == ()


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("cohere2", dict(sliding_window=None),
     "sliding_window must be a positive integer for Cohere2ForCausalLM, got None"),
    ("cohere2", dict(sliding_window=0), "sliding_window must be a positive integer"),
    ("cohere2", dict(layer_types=[SLIDE]), "layer_types must list one of sliding_attention, "
     "full_attention for each of the 2 layers"),
    ("cohere2", dict(layer_types=[SLIDE, "chunked_attention"]), "layer_types must list"),
    ("cohere2", dict(layer_types=None, sliding_window_pattern=0),
     "sliding_window_pattern must be a positive integer, got 0"),
    ("cohere2", dict(head_dim=32), "head_dim 32 is not supported for Cohere2ForCausalLM: "
     "transformers uses hidden_size / num_attention_heads = 16"),
    ("cohere2", dict(use_qk_norm=True), "use_qk_norm true is not supported for Cohere2"),
    ("cohere2", dict(logit_scale=0), "logit_scale must be a finite non-zero number, got 0"),
    ("cohere2", dict(hidden_act="gelu"),
     "hidden_act 'gelu' is not supported for Cohere2ForCausalLM"),
    ("olmo", dict(clip_qkv=0), "clip_qkv must be a positive number or null, got 0"),
    ("olmo", dict(clip_qkv="8"), "clip_qkv must be a positive number or null"),
    ("olmo", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for OlmoForCausalLM"),
    ("olmo", dict(intermediate_size=None), r"missing required field\(s\): intermediate_size"),
])
def test_bad_config_is_a_clear_error(name, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(name, **edit))


def test_model_type_alone_names_the_architecture():
    for name, arch in (("cohere2", "Cohere2ForCausalLM"), ("olmo", "OlmoForCausalLM")):
        raw = _raw(name)
        del raw["architectures"]
        assert ModelConfig.from_hf(raw).architecture == arch


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a Triton attention tile unpadded."""
    return build_tiny(tmp_path / name, name, hidden_size=128, num_attention_heads=2,
                      num_key_value_heads=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention (windowed and full), fused rotary + cache-write (interleaved, Cohere2's
    sliding layers) and plain cache-write (its NoPE layers) kernels, eager and in CUDA
    graphs, against transformers' fp32 tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    layers = llm.engine.model.model.layers
    assert layers[0].self_attn.rotary_emb.fused
    if name.startswith("cohere2"):
        assert layers[-1].self_attn.rotary_emb is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 (triton, graphs) against transformers' fp32 tokens, teacher-forced: ours picks
    fp32's token as often as transformers' own bf16 does (conftest's
    bf16_teacher_forced_hits: greedy bf16 runs of a tiny random model part chaotically)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton")
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total and ours16 >= 0.85 * total, (ours16, hf16, total)
