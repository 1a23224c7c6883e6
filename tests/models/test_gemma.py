"""Gemma 1/2/3 (models/gemma.py) token for token with transformers (fp32, CPU, eager
attention): prompts longer than the 8-token sliding window, Gemma 2's softcaps on, Gemma 3's
q/k norms, local rope base and linear-scaled global rope; chunked prompts over a cached
prefix and prefix hits; the (1 + w) norms folded at load and given back by hf_weights; the
config fields, and which attention backends take which family (and why not); the triton
backend (interpreted) with Gemma 2's softcap and Gemma 3's windows in our kernels."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.attention.registry import BackendUnavailable, backend_reasons, select_backend
from flashpage.config import ConfigError, ModelConfig
from flashpage.models.gemma import is_gemma_norm
from flashpage.models.loader import iter_safetensors, load_model, resolve_model
from tests.conftest import (
    bf16_teacher_forced_hits,
    hf_greedy,
    random_prompts,
    run_staggered,
    staggered_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
WINDOW = 8
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
# name -> (transformers config class, its fields over _BASE). Attention scales other than
# head_dim's (query_pre_attn_scalar); Gemma 3's q/k norms would leave scores of a 256
# scalar near zero and its tokens one repeated token, so it gets 4.
TINY_GEMMA: dict[str, tuple[str, dict]] = {
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=4.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
}
NAMES = sorted(TINY_GEMMA)
EAGER = dict(attn_implementation="eager")  # transformers' softcap path


def build_tiny_gemma(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """A tiny random Gemma checkpoint (fp32 safetensors + config.json) under ``path``.
    Norm weights w in [-0.5, 0.5] (the norms multiply by 1 + w), embeddings of std 0.02
    (scaled by sqrt(64) = 8 in the model: larger ones make every layer's residual the
    token's own embedding, and each prompt continue with one token repeated)."""
    import transformers

    cls_name, extra = TINY_GEMMA[name]
    config = getattr(transformers, cls_name)(**{**_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(-0.5, 0.5)
            elif "embed" in n:
                p.normal_(0, 0.02)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_tiny_gemma(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


def _greedy(path: Path, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native", **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(gemma_checkpoint, name):
    path = gemma_checkpoint(name)
    prompts = random_prompts(4, 12, 40, seed=1)  # all past the 8-token window
    expected = hf_greedy(path, prompts, GREEDY.max_tokens, **EAGER)
    assert _greedy(path, prompts) == expected
    assert len({t for toks in expected for t in toks}) > 12  # not one token repeated


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_chunked_prompts_and_prefix_hits_match_transformers(gemma_checkpoint, name):
    """Prompt chunks of 16 tokens over their cached prefix, decodes beside them, and
    prefix hits: the window and softcap on every path of the backend."""
    path = gemma_checkpoint(name)
    prompts = staggered_prompts()
    expected = hf_greedy(path, prompts, GREEDY.max_tokens, **EAGER)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16,
              max_num_seqs=4, attention_backend="torch_native")
    run = run_staggered(llm.engine, prompts, GREEDY)
    assert run["chunks"] and run["mixed_steps"]
    assert run["outputs"] == expected


def test_each_gemma_difference_changes_the_tokens(gemma_checkpoint, tmp_path):
    """Without the window, the attention softcap or Gemma 3's local rope base, transformers
    gives other tokens: the parity above depends on each."""
    prompts = random_prompts(4, 12, 40, seed=1)

    def hf(name: str, **cfg) -> list[list[int]]:
        return hf_greedy(build_tiny_gemma(tmp_path / f"{name}{len(cfg)}{sorted(cfg)}", name, **cfg),
                         prompts, GREEDY.max_tokens, **EAGER)

    g2 = hf_greedy(gemma_checkpoint("gemma2"), prompts, GREEDY.max_tokens, **EAGER)
    assert hf("gemma2", sliding_window=512) != g2
    assert hf("gemma2", attn_logit_softcapping=None) != g2
    g3 = hf_greedy(gemma_checkpoint("gemma3"), prompts, GREEDY.max_tokens, **EAGER)
    assert hf("gemma3", rope_local_base_freq=1_000_000.0) != g3
    assert hf("gemma3", sliding_window=512) != g3


def test_final_logit_softcap_in_the_logprobs(gemma_checkpoint):
    """Gemma 2's final_logit_softcapping keeps the argmax but not the distribution: our
    first-token logprobs are transformers' capped ones."""
    import transformers

    path = gemma_checkpoint("gemma2")
    prompt = random_prompts(1, 20, 20, seed=2)[0]
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend="torch_native")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    top = out.logprobs[0].top
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **EAGER)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    assert logits.abs().max() < 5.0  # capped at final_logit_softcapping
    want = torch.log_softmax(logits, dim=-1)
    for token, lp in top:
        assert lp == pytest.approx(want[token].item(), abs=1e-4)


def test_norms_fold_one_plus_w_and_hf_weights_give_it_back(gemma_checkpoint):
    path = gemma_checkpoint("gemma3")
    src = resolve_model(str(path))
    model = load_model(src, torch.float32, torch.device("cpu"))
    stored = dict(iter_safetensors(str(path)))
    params = dict(model.named_parameters())
    norms = [n for n in stored if is_gemma_norm(n)]
    # 3 layers x (4 norms + q/k norms) + the final norm
    assert len(norms) == 3 * 6 + 1
    for n in norms:
        assert torch.equal(params[n], stored[n] + 1.0), n
    back = dict(model.hf_weights())
    assert set(back) == set(stored)
    for n, t in stored.items():
        if is_gemma_norm(n):  # 1 + w in fp32 keeps w to half an ulp of 1
            torch.testing.assert_close(back[n], t, atol=2.0**-24, rtol=0)
        else:
            assert torch.equal(back[n], t), n
    assert "lm_head.weight" not in stored and model.lm_head.weight is model.model.embed_tokens.weight


def test_norms_stay_fp32_in_a_bf16_model_and_round_as_hf(gemma_checkpoint):
    """In a bf16 model the norms keep 1 + w in fp32 (rounded to bf16, 1 + w would keep ~8
    bits of a small w: the bf16 tokens parted from transformers') and multiply in fp32
    before the one rounding: each equals transformers' Gemma3RMSNorm bit for bit (the
    torch path; the kernel's rounding: tests/kernels/test_fused_ops.py)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    path = gemma_checkpoint("gemma3")
    model = load_model(resolve_model(str(path)), torch.bfloat16, torch.device("cpu"))
    stored = dict(iter_safetensors(str(path)))
    params = dict(model.named_parameters())
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    for n in (n for n in stored if is_gemma_norm(n)):
        assert params[n].dtype == torch.float32 and torch.equal(params[n], stored[n] + 1.0), n
        mod = model.get_submodule(n.rsplit(".", 1)[0])
        hf = Gemma3RMSNorm(mod.weight.shape[0], eps=mod.eps)
        with torch.no_grad():
            hf.weight.copy_(stored[n])
        # (transformers keeps w in the model's dtype: a bf16 checkpoint's w is exact there;
        # this one is fp32, whose w both sides take as stored)
        assert torch.equal(mod(x[:, :mod.weight.shape[0]]), hf(x[:, :mod.weight.shape[0]])), n


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_the_checkpoints_parameters(gemma_checkpoint, name):
    """flashpage inspect's count from the config alone (Gemma 2/3's four norms a layer, q/k
    norms, a tied head) is the number of values the checkpoint stores."""
    from flashpage.inspect import format_report, inspect_config, param_counts

    path = gemma_checkpoint(name)
    cfg = ModelConfig.from_hf(path)
    stored = sum(t.numel() for _, t in iter_safetensors(str(path)))
    assert param_counts(cfg) == (stored, stored)
    if name != "gemma":
        report = format_report(inspect_config(cfg, 1 << 30))
        assert re.search(r"sliding window +8 on 2 of 3 layers \(its layers' blocks behind it go "
                         r"back to the pool: KV cache groups\)", report), report
        # 1 full layer, 2 windowed: one slot a block, 1 full + 2 windowed groups
        assert re.search(r"KV cache groups +1 full \+ 2 windowed, 1 layer a block", report), report


def test_config_fields():
    g2 = ModelConfig.from_hf(dict(_BASE, model_type="gemma2"))
    assert g2.architecture == "Gemma2ForCausalLM" and g2.tie_word_embeddings
    # transformers' defaults where the config is silent: alternating windows from layer 0
    assert g2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [g2.attention_window(i) for i in range(3)] == [4096, None, 4096]
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.attention_scale == 256**-0.5 and g2.hidden_act == "gelu_pytorch_tanh"
    # a config written before transformers 5: rope_theta / rope_local_base_freq /
    # rope_scaling / sliding_window_pattern
    g3 = ModelConfig.from_hf(dict(
        _BASE, num_hidden_layers=7, model_type="gemma3_text", sliding_window=512,
        sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [g3.attention_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert (g3.rope_theta, g3.rope_local_theta, g3.qk_norm) == (1e6, 1e4, True)
    assert g3.rope_scaling is not None and g3.rope_scaling.factor == 8.0
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    # Gemma 1's legacy "gelu" means the tanh approximation (as transformers reads it)
    g1 = ModelConfig.from_hf(dict(_BASE, model_type="gemma", hidden_act="gelu"))
    assert g1.hidden_act == "gelu_pytorch_tanh" and g1.attention_window(0) is None
    assert g1.attention_scale == 16**-0.5


@pytest.mark.parametrize("fields,match", [
    (dict(model_type="gemma2", hidden_activation="silu"), "hidden_activation 'silu'"),
    (dict(model_type="gemma2", layer_types=["sliding_attention"]), "layer_types must list"),
    (dict(model_type="gemma2", layer_types=["local"] * 3), "layer_types must list"),
    (dict(model_type="gemma2", attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(model_type="gemma2", sliding_window=0), "sliding_window"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "bidirectional"),
    (dict(model_type="gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}), "sliding layers' rope"),
])
def test_config_errors_name_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(dict(_BASE, **fields))


def test_backends_say_which_gemma_they_run():
    """triton (the default on CUDA) runs Gemma 2's softcap and Gemma 3's per-layer windows;
    flex declines both, saying why."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    g2 = ModelConfig.from_hf(dict(_BASE, model_type="gemma2", head_dim=128))
    # 7 layers: the 6th global, the others windowed (a 3-layer Gemma 3 is all windowed)
    g3 = ModelConfig.from_hf(dict(_BASE, model_type="gemma3_text", head_dim=128, num_hidden_layers=7))
    all_local = ModelConfig.from_hf(dict(_BASE, model_type="gemma3_text", head_dim=128))
    assert not backend_reasons("flex", all_local, cuda, bf16)
    assert not backend_reasons("triton", g2, cuda, bf16)
    assert not backend_reasons("triton", g3, cuda, bf16)
    assert any("per-layer sliding windows" in r for r in backend_reasons("flex", g3, cuda, bf16))
    assert any("softcapping" in r for r in backend_reasons("flex", g2, cuda, bf16))
    with pytest.raises(BackendUnavailable, match="softcapping"):
        select_backend("flex", g2, cuda, bf16)
    assert select_backend(None, g2, cuda, bf16)[0].name == "triton"
    assert select_backend(None, g3, cuda, bf16)[0].name == "triton"


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_on_the_triton_backend_interpreted(tmp_path, name):
    """Our kernels (per-layer windows planned apart, Gemma 2's softcap in the decode and
    prefill kernels, the fused GELU-tanh·mul, RMSNorm and rotary) give transformers'
    tokens, head_dim 64, prompts chunked past the window."""
    pytest.importorskip("triton")
    path = build_tiny_gemma(tmp_path / name, name, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=64, query_pre_attn_scalar=16)
    prompts = random_prompts(2, 12, 30, seed=3)
    expected = hf_greedy(path, prompts, 6, **EAGER)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=16, attention_backend="triton",
              max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    acts = [m.mlp.act for m in llm.engine.model.model.layers]
    assert all(a.fused for a in acts)  # the GELU-tanh·mul kernel ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gemma_on_the_gpu_fp32_and_bf16(tmp_path, name):
    """On CUDA, the default backend (triton: the softcap and per-layer windows in our
    kernels), CUDA graphs and fused ops on: fp32 gives transformers' tokens; bf16 follows
    them about as closely as transformers' own bf16 does (teacher-forced)."""

    path = build_tiny_gemma(tmp_path / name, name, head_dim=64, num_attention_heads=4,
                            num_key_value_heads=2, hidden_size=128)
    prompts = random_prompts(24, 10, 100, seed=9)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens, **EAGER)

    def ours(dtype: str) -> list[list[int]]:
        llm = LLM(str(path), dtype=dtype, device="cuda", block_size=16, max_num_batched_tokens=64)
        assert llm.engine.backend_name == "triton"
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    assert ours("float32") == truth
    # bf16, teacher-forced: ours picks fp32's token as often as transformers' own bf16
    our_hits, hf_hits = bf16_teacher_forced_hits(path, prompts, truth, EAGER, block_size=16,
                                                 max_num_batched_tokens=64)
    total = sum(len(t) for t in truth)
    assert our_hits >= hf_hits - 0.03 * total and our_hits >= 0.85 * total, (our_hits, hf_hits)
