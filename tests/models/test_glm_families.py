"""GLM (GlmForCausalLM), GLM-4 (Glm4ForCausalLM: a norm after attention and after the MLP)
and GLM-4.5 / 4.6 (Glm4MoeForCausalLM: DeepSeek-V3's sigmoid-routed experts with shared
experts after first_k_dense_replace dense layers, optional per-head q/k norms): models/glm.py,
config._glm_fields.

CPU, fp32: greedy tokens equal transformers' for each family (rotary on the first half of
each head: interleaved pairs for GLM / GLM-4, halves for GLM-4.5); the partial rotary, the
interleaved layout, GLM-4's post-norms and GLM-4.5's correction bias each shown to change
the tokens; prompt logprobs equal transformers' log-softmax; GLM-4.5 on every expert path
(sync-free, grouped, the fused MoE kernel and router in the Triton interpreter) and its MoE
block against transformers' own; chunked prefill / preemption / prefix hits; GLM-4 and
GLM-4.5 on our Triton attention and rotary kernels (interpreter); the multi-token-prediction
layer skipped at load; weights back under HF's names (GLM-4's merged gate_up_proj);
``flashpage inspect``'s counts (tiny and the released shapes) and rows; config fields,
defaults and errors.
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens, and
bf16 follows fp32 about as far as transformers' bf16 does.

Every test needs transformers' config class for its family (GlmConfig, Glm4Config,
Glm4MoeConfig): it is skipped where the installed transformers lacks it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import format_report, inspect_config, param_counts
from flashpage.layers.moe import DeepseekMoE
from flashpage.layers.rotary import get_rope
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    assert_dense_params_match_hf,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    count_expert_path,
    cpu_greedy,
    cpu_llm,
    edited_copy,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    tiny_table_builder,
    use_expert_path,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (HF config class name, extra config kwargs); hidden 64, 4 heads
TINY: dict[str, tuple[str, dict]] = {
    # GLM: Llama's layer, rotary on interleaved pairs of the first half (GlmConfig's 0.5),
    # q/k/v biased (its default), GQA
    "glm": ("GlmConfig", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)),
    # no biases, a tied head, head_dim other than hidden / heads, 3/4 of each head rotated
    "glm_tied": ("GlmConfig", dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=32,
                                   attention_bias=False, tie_word_embeddings=True,
                                   partial_rotary_factor=0.75)),
    # GLM-4: post_self_attn / post_mlp norms besides, q/k/v biased, GQA
    "glm4": ("Glm4Config", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)),
    # every dim rotated, no biases, a tied head
    "glm4_full": ("Glm4Config", dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=32,
                                     attention_bias=False, tie_word_embeddings=True,
                                     partial_rotary_factor=1.0)),
    # GLM-4.5: a dense first layer, then 8 experts in 2 groups (the best group kept), top-2
    # normalized x 2.5, one shared expert; per-head q/k norms; q/k/v biased
    "glm4_moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                                       n_routed_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, n_group=2, topk_group=1,
                                       routed_scaling_factor=2.5, use_qk_norm=True,
                                       attention_bias=True, first_k_dense_replace=1)),
    # no dense layer, no q/k norm, no bias; top-3 of 8 in one group, not normalized; 2 shared
    # experts; head_dim hidden / heads (Glm4MoeConfig has none of its own)
    "glm4_moe_plain": ("Glm4MoeConfig", dict(num_hidden_layers=2, num_key_value_heads=4,
                                             n_routed_experts=8, num_experts_per_tok=3,
                                             moe_intermediate_size=24, n_shared_experts=2,
                                             norm_topk_prob=False, first_k_dense_replace=0)),
}
NAMES = sorted(TINY)
MOE = ["glm4_moe", "glm4_moe_plain"]


def _hf_class(name: str) -> str:
    """The family's transformers config class name; skips the test where it is missing
    (an older transformers, e.g. a GPU image's)."""
    cls_name = TINY[name][0]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return cls_name


_build = tiny_table_builder(TINY)


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    _hf_class(name)
    return _build(path, name, seed, **overrides)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _prompts() -> list[list[int]]:
    return random_prompts(3, 5, 40, seed=1)


def _arch(name: str) -> str:
    return _hf_class(name).replace("Config", "ForCausalLM")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    assert cpu_greedy(path, _prompts()) == hf_greedy(path, _prompts(), GREEDY.max_tokens)


def test_layers_are_built_as_configured(tiny):
    """GLM / GLM-4: interleaved pairs over half of each head (GLM-4's norms after attention
    and the MLP); GLM-4.5: halves, q/k norms per head, the dense layers before the MoE."""
    def layers(name):
        return cpu_llm(tiny(name)).engine.model.model.layers

    for name, rot, neox in (("glm", 8, False), ("glm_tied", 24, False), ("glm4", 8, False),
                            ("glm4_full", 32, False), ("glm4_moe", 8, True),
                            ("glm4_moe_plain", 8, True)):
        lay = layers(name)
        rope = lay[0].self_attn.rotary_emb
        assert (rope.inv_freq.numel() * 2, rope.is_neox) == (rot, neox), name
        assert lay[0].self_attn.o_proj.bias is None
    glm4 = layers("glm4")[0]
    assert {"post_self_attn_layernorm", "post_mlp_layernorm"} <= dict(glm4.named_children()).keys()
    assert glm4.self_attn.qkv_proj.bias is not None
    assert not hasattr(layers("glm")[0], "post_mlp_layernorm")
    moe = layers("glm4_moe")
    assert [isinstance(lay.mlp, DeepseekMoE) for lay in moe] == [False, True, True]
    assert moe[1].self_attn.qk_norm and tuple(moe[1].self_attn.q_norm.weight.shape) == (16,)
    gate = moe[1].mlp.gate
    assert (gate.method, gate.n_group, gate.topk_group, gate.norm_topk_prob,
            gate.routed_scaling_factor) == ("noaux_tc", 2, 1, True, 2.5)
    assert moe[1].mlp.shared_experts.down_proj.weight.shape == (64, 32)
    plain = layers("glm4_moe_plain")
    assert [isinstance(lay.mlp, DeepseekMoE) for lay in plain] == [True, True]
    assert not plain[0].self_attn.qk_norm and plain[0].self_attn.qkv_proj.bias is None
    assert plain[0].mlp.shared_experts.down_proj.weight.shape == (64, 48)  # 2 x 24


def test_each_difference_changes_the_tokens(tiny):
    """Ours equal transformers' (test_greedy_matches_transformers) and each of these matters
    on these prompts: the partial rotary, GLM-4's interleaved layout and post-norms,
    GLM-4.5's correction bias and routed scaling."""
    prompts = _prompts()[:2]
    base: dict[str, list[list[int]]] = {}

    def differs(name: str, llm=None, **overrides) -> bool:
        if name not in base:
            base[name] = cpu_greedy(tiny(name), prompts)
        if llm is None:
            return cpu_greedy(tiny(name), prompts, hf_overrides=overrides) != base[name]
        return [o.outputs[0].token_ids
                for o in llm.generate(prompts, GREEDY, use_tqdm=False)] != base[name]

    assert differs("glm4", partial_rotary_factor=1.0)
    assert differs("glm4_moe", partial_rotary_factor=1.0)
    assert differs("glm4_moe", routed_scaling_factor=1.0)
    llm = cpu_llm(tiny("glm4"))  # rotate halves (Llama's layout) instead of interleaved pairs
    halves = replace(llm.engine.model.config, rope_interleaved=False)
    for lay in llm.engine.model.model.layers:
        lay.self_attn.rotary_emb = get_rope(halves, 512, 0)
    assert differs("glm4", llm)
    llm = cpu_llm(tiny("glm4"))  # GLM-4 without its post-norms: GLM's layer
    for lay in llm.engine.model.model.layers:
        lay.post_self_attn_layernorm = lay.post_mlp_layernorm = torch.nn.Identity()
    assert differs("glm4", llm)
    llm = cpu_llm(tiny("glm4_moe"))  # routed without the correction bias
    for lay in llm.engine.model.model.layers[1:]:
        lay.mlp.gate.e_score_correction_bias.zero_()
    assert differs("glm4_moe", llm)


@pytest.mark.parametrize("name", ["glm_tied", "glm4", "glm4_moe"])
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves, not only their argmax: each prompt token's logprob is
    transformers' log-softmax."""
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


@pytest.mark.parametrize("path", ["sync_free", "grouped", "fused"])
def test_moe_greedy_matches_transformers_on_every_expert_path(tiny, path, monkeypatch):
    """GLM-4.5's experts sync-free, grouped, or through kernels/fused_moe.py and
    kernels/moe_router.py (Triton interpreter on the CPU), each seen to run."""
    ckpt = tiny("glm4_moe")
    prompts = random_prompts(2, 5, 30, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(ckpt), dtype="float32", device=DEV if path == "fused" else "cpu",
              block_size=8, attention_backend="torch_native")
    use_expert_path(llm.engine.model, path)
    calls = count_expert_path(monkeypatch, path)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, prompts, params.max_tokens)
    assert calls and min(calls) <= 2 and max(calls) > 5  # decode steps and prompts took it


@pytest.mark.parametrize("kw", [
    dict(n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
         routed_scaling_factor=2.5, n_shared_experts=1),
    dict(n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
         routed_scaling_factor=1.0, n_shared_experts=2),
], ids=["groups", "one_group"])
def test_moe_block_matches_hf(kw):
    """Our DeepseekMoE built from Glm4MoeConfig's fields against transformers' Glm4MoeMoE
    (its router with a correction bias, experts, shared experts), on HF's own weights."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    _hf_class("glm4_moe")
    conf = transformers.Glm4MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8,
        moe_intermediate_size=24, **kw)
    torch.manual_seed(3)
    hf = Glm4MoeMoE(conf).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    cfg = ModelConfig.from_hf({**conf.to_dict(), "architectures": ["Glm4MoeForCausalLM"]})
    ours = DeepseekMoE(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)  # HF's fused experts, split shared ones
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(x)
        _, hf_w, hf_ids = hf.gate(x)
        got_w, got_ids = ours.gate(x.reshape(-1, 32))
        got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_ids.sort(1).values, hf_ids.sort(1).values)
    torch.testing.assert_close(got_w.gather(1, got_ids.sort(1).indices),
                               hf_w.gather(1, hf_ids.sort(1).indices))


@pytest.mark.parametrize("name", ["glm4", "glm4_moe"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


def _gpu_checkpoint(tmp_path: Path, name: str, **overrides) -> Path:
    """head_dim 64, the smallest the Triton attention kernels take (32 of it rotated)."""
    kw = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    return build_tiny(tmp_path / name, name, **{**kw, **overrides})


@pytest.mark.parametrize("name", ["glm4", "glm4_moe"])
def test_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend (interpreter on the CPU), one short prompt: the fused rotary +
    cache-write kernel over the first half of each head, interleaved pairs (GLM-4) or halves
    after the q/k norms (GLM-4.5)."""
    path = _gpu_checkpoint(tmp_path, name, num_hidden_layers=2)
    prompts = random_prompts(1, 20, 20, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    assert llm.engine.model.model.layers[0].self_attn.rotary_emb.fused
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


# ----------------------------------------------------------------- loading
@pytest.mark.parametrize("name", ["glm", "glm_tied", "glm4", "glm4_full"])
def test_weights_come_back_under_hf_names(tiny, name):
    """GLM / GLM-4's merged mlp.gate_up_proj loads and comes back as it is (and a LoRA
    adapter may name it)."""
    model, ref = load_and_round_trip(tiny(name))
    assert "model.layers.1.mlp.gate_up_proj.weight" in ref
    assert "model.layers.1.mlp.gate_proj.weight" not in ref
    assert model.lora_targets()["model.layers.1.mlp.gate_up_proj"] == (
        "model.layers.1.mlp.gate_up_proj", 0, 256)


def test_moe_weights_come_back_and_the_mtp_layer_is_skipped(tiny, tmp_path):
    """GLM-4.5: every dense tensor (correction biases, the shared experts' gate / up) back
    under HF's names; a checkpoint with a multi-token-prediction layer after the last one
    (num_nextn_predict_layers, as GLM-4.5's files hold it) loads and gives the same tokens."""
    from flashpage.models.loader import iter_safetensors

    path = tiny("glm4_moe")
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    ref = dict(iter_safetensors(str(path)))
    mine = dict(model.hf_weights())
    dense = {n for n in ref if ".experts." not in n or ".shared_experts." in n}
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in dense
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in dense
    assert all(torch.equal(mine[n], ref[n]) for n in dense)
    torch.testing.assert_close(  # expert 5's up_proj: rows [I:] of its fused gate_up_proj
        mine["model.layers.1.mlp.experts.gate_up_proj"][5, 32:],
        ref["model.layers.1.mlp.experts.5.up_proj.weight"])

    def add_mtp(t):
        for k in [k for k in t if k.startswith("model.layers.2.")]:
            t[k.replace("model.layers.2.", "model.layers.3.")] = t[k].clone()
        t["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        t["model.layers.3.enorm.weight"] = torch.ones(64)

    mtp = edited_copy(path, tmp_path / "mtp", add_mtp,
                      lambda c: c.update(num_nextn_predict_layers=1))
    assert cpu_greedy(mtp, _prompts()[:1]) == cpu_greedy(path, _prompts()[:1])


# ----------------------------------------------------------------- inspect
@pytest.mark.parametrize("name", ["glm", "glm_tied", "glm4", "glm4_full"])
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


@pytest.mark.parametrize("name", MOE)
def test_inspect_moe_counts_are_the_models_own(tiny, name):
    """Total: every parameter and correction bias the engine's model holds (transformers'
    count, plus the biases, which it keeps as buffers); active: less the experts a token
    does not use."""
    path = tiny(name)
    source = resolve_model(str(path))
    model = load_model(source, torch.float32, torch.device("cpu"))
    cfg = source.config
    total, active = param_counts(cfg)
    moe_layers = sum(isinstance(lay.mlp, DeepseekMoE) for lay in model.model.layers)
    assert total == sum(p.numel() for p in model.parameters()) + moe_layers * 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert total == hf.num_parameters() + moe_layers * 8
    idle = (8 - cfg.num_experts_per_tok) * 3 * 64 * cfg.moe_intermediate_size
    assert total - active == idle * moe_layers


# the released config.json shapes
FULL_SIZE = {
    "glm": dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696,
                num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
                head_dim=128, pad_token_id=0),  # glm-4-9b-chat-hf
    "glm4": dict(vocab_size=151552, hidden_size=6144, intermediate_size=23040,
                 num_hidden_layers=61, num_attention_heads=48, num_key_value_heads=2,
                 head_dim=128, max_position_embeddings=32768, pad_token_id=0),  # GLM-4-32B-0414
    "glm4_moe": dict(vocab_size=151552, hidden_size=5120, intermediate_size=12288,
                     num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8,
                     head_dim=128, moe_intermediate_size=1536, n_routed_experts=160,
                     n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                     use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
                     rope_theta=1_000_000.0),  # GLM-4.5
    "glm4_moe_plain": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                           num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                           head_dim=128, moe_intermediate_size=1408, n_routed_experts=128,
                           n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                           attention_bias=True),  # GLM-4.5-Air
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_inspect_counts_full_size_models(name):
    """The released shapes, against transformers' model built on the meta device (its count
    leaves out the routers' correction biases, buffers there); KV bytes and the report's
    rotary and expert rows."""
    hf_cfg = getattr(transformers, _hf_class(name))(**FULL_SIZE[name])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [_arch(name)]})
    info = inspect_config(cfg, 80 * 2**30)
    biases = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * (
        cfg.n_routed_experts or 0)
    assert info["param_count"] == hf.num_parameters() + biases
    kv = FULL_SIZE[name]["num_key_value_heads"]
    assert info["kv_bytes_per_token"] == 2 * kv * 128 * 2 * cfg.num_hidden_layers
    report = format_report(info)
    if name.startswith("glm4_moe"):
        assert "rotary                         first 64 of 128 dims\n" in report
    else:
        assert "first 64 of 128 dims, interleaved pairs (GPT-J's layout)" in report
    if name == "glm4_moe":  # GLM-4.5: 355B with its MTP layer (3.7B), 32B active
        assert "8 of 160 per token (intermediate 1536, a shared MLP of 1536), in 89 of 92" in report
        assert info["param_count"] == pytest.approx(352.8e9, rel=1e-3)
        assert info["active_param_count"] == pytest.approx(33.6e9, rel=1e-2)
    if name == "glm4_moe_plain":  # GLM-4.5-Air: 106B, 12B active
        assert info["param_count"] == pytest.approx(106.9e9, rel=1e-3)
        assert "in 45 of 46 layers" in report


def test_inspect_cli_on_a_checkpoint(tiny, capsys):
    from flashpage.inspect import main

    assert main([str(tiny("glm4"))]) == 0
    out = capsys.readouterr().out
    assert "Glm4ForCausalLM (glm4)" in out
    assert "first 8 of 16 dims, interleaved pairs" in out
    assert main([str(tiny("glm4_moe"))]) == 0
    out = capsys.readouterr().out
    assert "Glm4MoeForCausalLM (glm4_moe)" in out and "in 2 of 3 layers" in out


# ----------------------------------------------------------------- config
def _raw(name: str, **edit) -> dict:
    cls_name, extra = TINY[name]
    d = getattr(transformers, _hf_class(name))(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=512, pad_token_id=0, **extra).to_dict()
    d["architectures"] = [cls_name.replace("Config", "ForCausalLM")]
    d.update(edit)
    return d


def _bare(name: str, *drop: str) -> dict:
    """``_raw(name)`` without ``drop``: what an older or hand-written config.json holds."""
    return {k: v for k, v in _raw(name).items() if k not in drop}


def test_config_fields():
    g = ModelConfig.from_hf(_raw("glm4"))
    assert (g.architecture, g.rotary_dim, g.rope_interleaved, g.attention_bias, g.o_proj_bias,
            g.n_routed_experts) == ("Glm4ForCausalLM", 8, True, True, False, None)
    # Glm4Config's / GlmConfig's defaults where config.json says nothing
    for name in ("glm", "glm4"):
        g = ModelConfig.from_hf(_bare(name, "head_dim", "num_key_value_heads", "rms_norm_eps",
                                      "rope_parameters", "attention_bias", "eos_token_id",
                                      "max_position_embeddings"))
        assert (g.head_dim, g.num_key_value_heads, g.rms_norm_eps, g.partial_rotary_factor,
                g.rotary_dim, g.attention_bias, g.eos_token_id, g.max_position_embeddings) == (
            128, 2, 1.5625e-7, 0.5, 64, True, (151329, 151336, 151338), 131072), name
    # the factor at the top of an older config.json
    g = ModelConfig.from_hf({**_bare("glm4", "rope_parameters"), "partial_rotary_factor": 0.25})
    assert g.rotary_dim == 4
    m = ModelConfig.from_hf(_raw("glm4_moe"))
    assert (m.n_routed_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.n_shared_experts, m.first_k_dense_replace, m.topk_method, m.n_group, m.topk_group,
            m.norm_topk_prob, m.routed_scaling_factor, m.qk_norm, m.attention_bias,
            m.o_proj_bias, m.rope_interleaved, m.rotary_dim) == (
        8, 2, 32, 1, 1, "noaux_tc", 2, 1, True, 2.5, True, True, False, False, 8)
    assert [m.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # Glm4MoeConfig's defaults
    m = ModelConfig.from_hf(_bare("glm4_moe", "n_shared_experts", "first_k_dense_replace",
                                  "norm_topk_prob", "use_qk_norm", "attention_bias",
                                  "rms_norm_eps", "routed_scaling_factor", "n_group",
                                  "topk_group", "head_dim", "rope_parameters"))
    assert (m.n_shared_experts, m.first_k_dense_replace, m.norm_topk_prob, m.qk_norm,
            m.attention_bias, m.rms_norm_eps, m.routed_scaling_factor, m.n_group, m.head_dim,
            m.rotary_dim) == (1, 1, True, False, False, 1e-5, 1.0, 1, 16, 8)
    # transformers' alias for the expert count
    m = ModelConfig.from_hf({**_bare("glm4_moe", "n_routed_experts"), "num_local_experts": 8})
    assert m.n_routed_experts == 8


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("glm4", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for Glm4ForCausalLM"),
    ("glm", dict(attention_bias="yes"), "attention_bias must be true or false, got 'yes'"),
    ("glm4", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.1}),
     "partial_rotary_factor must be in \\(0, 1\\] and give an even rotary width"),
    ("glm4", dict(head_dim=0), "head_dim must be a positive integer, got 0"),
    ("glm4", dict(num_key_value_heads=3), "num_attention_heads \\(4\\) is not a multiple of "
     "num_key_value_heads \\(3\\)"),
    ("glm4", dict(intermediate_size=None), r"missing required field\(s\): intermediate_size"),
    ("glm4", dict(rms_norm_eps=-1), "rms_norm_eps must be a positive number, got -1"),
    ("glm4_moe", dict(n_routed_experts=0), "n_routed_experts must be a positive integer, got 0"),
    ("glm4_moe", dict(num_experts_per_tok=None),
     "num_experts_per_tok must be a positive integer, got None"),
    ("glm4_moe", dict(n_group=3), "n_group \\(3\\) must split n_routed_experts \\(8\\) into "
     "equal groups of at least 2"),
    ("glm4_moe", dict(n_group=8), "n_group \\(8\\) must split"),
    ("glm4_moe", dict(topk_group=3), "topk_group \\(3\\) must be at most n_group \\(2\\)"),
    ("glm4_moe", dict(num_experts_per_tok=5), "num_experts_per_tok \\(5\\) must be at most "
     "the 4 experts of the topk_group \\(1\\) groups kept"),
    ("glm4_moe", dict(n_shared_experts=-1), "n_shared_experts must be an integer >= 0, got -1"),
    ("glm4_moe", dict(first_k_dense_replace=4), "first_k_dense_replace must be an integer in "
     "\\[0, 3\\] \\(num_hidden_layers\\), got 4"),
    ("glm4_moe", dict(intermediate_size=None), "intermediate_size must be a positive integer "
     "\\(dense MLP in the first 1 layer\\(s\\)\\), got None"),
    ("glm4_moe", dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    ("glm4_moe", dict(routed_scaling_factor="2"), "routed_scaling_factor must be a positive number"),
    ("glm4_moe", dict(use_qk_norm=1), "use_qk_norm must be true or false, got 1"),
    ("glm4_moe", dict(norm_topk_prob="no"), "norm_topk_prob must be true or false"),
    ("glm4", dict(quantization_config=AWQ), "awq \\(int4\\) checkpoints are read for the dense "
     "Llama, Gemma and Llama-variant families and Mixtral / Qwen2-MoE / Qwen3-MoE, not "
     "Glm4ForCausalLM"),
])
def test_bad_config_is_a_clear_error(name, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(name, **edit))


def test_model_type_alone_names_the_architecture():
    for name in ("glm", "glm4", "glm4_moe"):
        raw = _raw(name)
        del raw["architectures"]
        assert ModelConfig.from_hf(raw).architecture == _arch(name)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention, fused rotary + cache-write (partial, interleaved or halves) and, for
    GLM-4.5, fused MoE kernels, eager and in CUDA graphs, against transformers' fp32 tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    assert llm.engine.model.model.layers[0].self_attn.rotary_emb.fused


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
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton",
                                            block_size=16)
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total, (ours16, hf16, total)
    if name not in MOE:  # (expert choices flip at bf16 near-ties too: no floor there)
        assert ours16 >= 0.85 * total, (ours16, total)
