"""Phi-3 (merged checkpoint projections, partial rotary, longrope, window, tied head),
Granite (embedding / residual / attention / logits multipliers) and OLMo2 (post-norms,
whole-width q/k norms): models/phi3.py, granite.py, olmo2.py.

CPU, fp32: greedy tokens equal transformers' for each family; longrope with max_model_len
above original_max_position_embeddings (long factors) and at most it (short factors),
each against transformers on prompts that keep it on the same factors all along, and our
cos/sin caches against transformers' rotary module; prompt logprobs (Granite's logits
scaling); OLMo2 / Granite over chunked prefill, preemption and prefix hits; Phi-3 / OLMo2 on
our Triton kernels (interpreter); the fused rotary kernel on the partial width; Llama's
o_proj bias; weights back under HF's names; ``flashpage inspect``'s parameter counts and
rotary row; config errors.
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens,
and bf16 follows fp32 about as far as transformers' bf16 does.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.rotary import get_rope
from flashpage.models.loader import iter_safetensors
from tests.conftest import (
    _checkpoints,
    _save_tiny_routed,
    assert_dense_params_match_hf,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    cpu_greedy,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    tiny_table_builder,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ORIGINAL = 32  # phi3_longrope's original_max_position_embeddings
# head_dim 16, partial_rotary_factor 0.75: 12 rotary dims, 6 factors each
SHORT = [1.0, 1.2, 1.5, 2.1, 2.9, 4.0]
LONG = [1.5, 2.8, 4.6, 7.5, 11.0, 16.0]

# name -> (HF config class name, extra config kwargs); 2 layers, hidden 64, 4 heads
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    # Phi-4-mini's shape: GQA, 3/4 of each head rotated, longrope (max_position_embeddings
    # 512 over an original 32: attention factor sqrt(1 + ln 16 / ln 32) = 1.34)
    "phi3_longrope": ("Phi3Config", dict(
        num_key_value_heads=2, partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL,
        rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG))),
    # Phi-3-mini's: a sliding window shorter than the prompts, half the head rotated, tied head
    "phi3_window_tied": ("Phi3Config", dict(num_key_value_heads=4, sliding_window=24,
                                            partial_rotary_factor=0.5, tie_word_embeddings=True)),
    "granite": ("GraniteConfig", dict(
        num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.09, logits_scaling=8.0, attention_bias=True,
        tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2, attention_bias=True)),
}
NAMES = sorted(TINY_VARIANTS)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


_build_table = tiny_table_builder(TINY_VARIANTS)


def build_tiny_variant(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """The table's checkpoint with 2 layers (the config classes default to 32: 16x the CPU
    time, Granite's staggered test 71 s in CI) unless ``overrides`` say otherwise."""
    return _build_table(path, name, seed, **{"num_hidden_layers": 2, **overrides})


@pytest.fixture(scope="module")
def tiny_variant(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny_variant)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny_variant, name):
    path = tiny_variant(name)
    # phi3_longrope: prompts longer than the original 32 positions, so transformers takes
    # the long factors from the first step, as we do for max_model_len 512
    prompts = (random_prompts(3, 33, 60, seed=1) if name == "phi3_longrope"
               else random_prompts(3, 5, 40, seed=1))
    assert cpu_greedy(path, prompts) == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_transformers(tiny_variant, name):
    """The logits themselves, not only their argmax (Granite's logits_scaling shows here
    alone): each prompt token's logprob is transformers' log-softmax."""
    path = tiny_variant(name)
    prompt = random_prompts(1, 40, 40, seed=5)[0]  # past 32: longrope's long factors
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    want = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_longrope_short_factors_within_the_original_length(tiny_variant):
    """max_model_len 32 (<= original_max_position_embeddings): the short factors, as
    transformers takes for sequences that never pass 32 positions."""
    path = tiny_variant("phi3_longrope")
    prompts = random_prompts(3, 5, 20, seed=2)
    assert max(map(len, prompts)) + GREEDY.max_tokens <= ORIGINAL
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert cpu_greedy(path, prompts, max_model_len=ORIGINAL) == expected
    # the long factors give other tokens here: the choice is really made
    assert cpu_greedy(path, prompts, max_model_len=4 * ORIGINAL) != expected


@pytest.mark.parametrize("max_positions", [ORIGINAL, 4 * ORIGINAL])
def test_longrope_cos_sin_match_transformers(max_positions):
    """Our cos/sin cache (attention factor included, rotary dims only) is transformers'
    Phi3RotaryEmbedding output for sequences on the same side of the original length."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls_name, extra = TINY_VARIANTS["phi3_longrope"]
    hf_cfg = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=512, **extra)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    assert cfg.rotary_dim == 12 and cfg.rope_scaling is not None
    factor = math.sqrt(1 + math.log(512 / ORIGINAL) / math.log(ORIGINAL))
    assert cfg.rope_scaling.attention_factor == pytest.approx(factor)
    ours = get_rope(cfg, max_positions)
    positions = torch.arange(max_positions)[None]
    cos, sin = Phi3RotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
    half = cfg.rotary_dim // 2
    assert cos.shape[-1] == cfg.rotary_dim
    assert torch.equal(ours.cos_sin_cache[:, :half], cos[0, :, :half])
    assert torch.equal(ours.cos_sin_cache[:, half:], sin[0, :, :half])


def test_fused_rotary_kernel_on_the_partial_width():
    """The Triton rotary kernel (interpreter on the CPU) rotates the first rotary_dim dims
    of each head as the torch path does and leaves the rest as they are."""
    _, extra = TINY_VARIANTS["phi3_longrope"]
    cfg = ModelConfig.from_hf(transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, **extra).to_dict())
    rope = get_rope(cfg, 128).to(DEV)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 4, 16, generator=g).to(DEV), torch.randn(9, 2, 16, generator=g).to(DEV)
    positions = torch.tensor([0, 1, 5, 31, 32, 33, 64, 100, 127], device=DEV)
    want = rope(positions, q, k)
    rope.fused = True
    got = rope(positions, q.clone(), k.clone())
    for w, g_, x in zip(want, got, (q, k), strict=True):
        torch.testing.assert_close(g_, w, atol=1e-5, rtol=1e-5)
        assert torch.equal(g_[..., 12:], x[..., 12:])
        assert not torch.allclose(g_[..., :12], x[..., :12])


@pytest.mark.parametrize("name", ["olmo2", "granite"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny_variant, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens
    (OLMo2's own residual stream, Granite's multipliers, over chunks)."""
    assert_staggered_matches_hf(tiny_variant(name), attention_backend="torch_native")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi3_longrope", "olmo2"])
def test_greedy_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend (our attention, RMSNorm, SiLU-mul and fused rotary + cache-write
    kernels; on the CPU in the interpreter, ~50 s each): Phi-3's 48 rotary dims of 64 with
    the long factors, OLMo2's norms over the whole q / k projections."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(1, 34, 34, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    rotary = llm.engine.model.model.layers[0].self_attn.rotary_emb
    assert rotary.fused and rotary.cos_sin_cache.shape[1] == (48 if name == "phi3_longrope" else 64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


def test_llama_attention_bias_biases_o_proj_too(tmp_path):
    """HF's Llama puts attention_bias on o_proj as on q/k/v (Granite and OLMo2 reuse
    LlamaAttention): the checkpoint loads and gives transformers' tokens."""
    path = _save_tiny_routed(tmp_path / "llama_bias", "LlamaConfig",
                             dict(num_hidden_layers=2, num_key_value_heads=2, attention_bias=True),
                             0, False)
    assert "model.layers.0.self_attn.o_proj.bias" in dict(iter_safetensors(str(path)))
    prompts = random_prompts(2, 5, 30, seed=4)
    assert cpu_greedy(path, prompts) == hf_greedy(path, prompts, GREEDY.max_tokens)


# ----------------------------------------------------------------- loading, inspect
@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny_variant, name):
    path = tiny_variant(name)
    model, ref = load_and_round_trip(path)
    if name.startswith("phi3"):  # the checkpoint's merged projections, loaded as they are
        assert "model.layers.0.self_attn.qkv_proj.weight" in ref
        assert "model.layers.0.mlp.gate_up_proj.weight" in ref
        targets = model.lora_targets()
        kv = model.config.num_key_value_heads
        assert targets["model.layers.1.self_attn.qkv_proj"] == (
            "model.layers.1.self_attn.qkv_proj", 0, (4 + 2 * kv) * 16)
        assert targets["model.layers.1.mlp.gate_up_proj"][2] == 256


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny_variant, name):
    assert_dense_params_match_hf(tiny_variant(name))


def test_inspect_reports_partial_rotary_and_longrope(tiny_variant, capsys):
    from flashpage.inspect import main

    assert main([str(tiny_variant("phi3_longrope"))]) == 0
    out = capsys.readouterr().out
    assert "Phi3ForCausalLM (phi3)" in out
    assert "first 12 of 16 dims, longrope: long factors when max_model_len > 32" in out
    assert main([str(tiny_variant("granite"))]) == 0
    assert "rotary" not in capsys.readouterr().out  # all of each head, unscaled: no row


def test_config_fields():
    phi = ModelConfig.from_hf(_raw("phi3_longrope"))
    assert phi.architecture == "Phi3ForCausalLM" and phi.partial_rotary_factor == 0.75
    assert phi.rope_scaling is not None and phi.rope_scaling.rope_type == "longrope"
    assert phi.rope_scaling.short_factor == tuple(SHORT)
    assert phi.rope_scaling.long_factor == tuple(LONG)
    assert phi.rope_scaling.original_max_position_embeddings == ORIGINAL
    # an attention_factor in the config wins; Phi-3's first configs say "su"
    own = ModelConfig.from_hf(_raw("phi3_longrope", rope_scaling=dict(
        type="su", short_factor=SHORT, long_factor=LONG, attention_factor=1.2)))
    assert own.rope_scaling is not None and own.rope_scaling.attention_factor == 1.2
    window = ModelConfig.from_hf(_raw("phi3_window_tied"))
    assert (window.sliding_window, window.rotary_dim, window.tie_word_embeddings) == (24, 8, True)
    granite = ModelConfig.from_hf(_raw("granite"))
    assert (granite.embedding_multiplier, granite.residual_multiplier,
            granite.attention_multiplier, granite.logits_scaling) == (12.0, 0.22, 0.09, 8.0)
    assert granite.attention_bias
    olmo = ModelConfig.from_hf(_raw("olmo2"))
    assert olmo.architecture == "Olmo2ForCausalLM" and not olmo.qk_norm
    # model_type alone names the architecture
    bare = {k: v for k, v in _raw("olmo2").items() if k != "architectures"}
    assert ModelConfig.from_hf(bare).architecture == "Olmo2ForCausalLM"


# ----------------------------------------------------------------- config errors
def _raw(name: str, **edit) -> dict:
    cls_name, extra = TINY_VARIANTS[name]
    d = getattr(transformers, cls_name)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, **extra).to_dict()
    d["architectures"] = [cls_name.replace("Config", "ForCausalLM")]
    d.update(edit)
    return d


def _longrope(**kw) -> dict:
    return dict(rope_scaling={"rope_type": "longrope", "short_factor": SHORT,
                              "long_factor": LONG, **kw}, rope_parameters=None)


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("phi3_longrope", _longrope(short_factor=SHORT[:4]),
     r"short_factor must be a list of 6 positive numbers \(one per rotated pair of the 12 "
     r"rotary dims\), got 4 values"),
    ("phi3_longrope", _longrope(long_factor="2.0"), r"long_factor must be a list of 6 positive"),
    ("phi3_longrope", _longrope(long_factor=[1.0] * 5 + [-1.0]), "long_factor must be a list"),
    ("phi3_longrope", {**_longrope(), "original_max_position_embeddings": None},
     "longrope needs original_max_position_embeddings"),
    ("phi3_longrope", _longrope(attention_factor=-1), "attention_factor must be a positive number"),
    ("phi3_longrope", dict(partial_rotary_factor=0.0), "partial_rotary_factor must be in"),
    ("phi3_longrope", dict(partial_rotary_factor=1.5), "partial_rotary_factor must be in"),
    ("phi3_window_tied", dict(partial_rotary_factor=0.2, rope_parameters=None),
     "even rotary width"),
    ("granite", dict(logits_scaling=0), "logits_scaling must be a positive number, got 0"),
    ("granite", dict(embedding_multiplier="12"), "embedding_multiplier must be a positive number"),
    ("granite", dict(residual_multiplier=float("nan")), "residual_multiplier must be a positive"),
    ("granite", dict(mlp_bias=True), "mlp_bias true is not supported for GraniteForCausalLM"),
    ("olmo2", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for Olmo2ForCausalLM"),
    ("olmo2", _longrope(original_max_position_embeddings=32),
     "'longrope' is read for Phi3ForCausalLM only, not Olmo2ForCausalLM"),
])
def test_bad_config_is_a_clear_error(name, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(name, **edit))


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a Triton attention tile unpadded (longrope: 48 rotary
    dims, 24 factors each)."""
    over: dict = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    # 2 layers (build_tiny_variant's): Phi3Config's default 32 pre-norm layers of widened
    # (std 0.2) weights grew the residual stream to std ~50 and bf16's error past it, so bf16
    # lost fp32's token at most steps, transformers' own bf16 included (61 and 175 of 384,
    # run 184)
    if name == "phi3_longrope":
        g = torch.Generator().manual_seed(0)
        short = (1 + torch.rand(24, generator=g).cumsum(0) / 4).tolist()
        over["rope_scaling"] = dict(type="longrope", short_factor=short,
                                    long_factor=[2 * f for f in short])
    return build_tiny_variant(tmp_path / name, name, **over)


def _gpu_prompts(name: str, n: int, seed: int) -> list[list[int]]:
    # longrope: past the original 32 positions from the start (transformers: long factors)
    return random_prompts(n, 33 if name == "phi3_longrope" else 1, 120, seed=seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    path = _gpu_checkpoint(tmp_path, name)
    # seed 22: transformers' fp32 top-2 logprobs are >= 1.4e-3 apart at every step of every
    # family (on the CPU), far above what fp32 on the GPU and on the CPU differ by
    assert_gpu_graphs_match_hf(path, _gpu_prompts(name, 8, seed=22))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 (triton, graphs) against transformers' fp32 tokens, teacher-forced: ours picks
    fp32's token as often as transformers' own bf16 does (conftest's
    bf16_teacher_forced_hits: greedy bf16 runs of a tiny random model part chaotically)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = _gpu_prompts(name, 32, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth)
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total and ours16 >= 0.85 * total, (ours16, hf16, total)
