"""DeepseekMoE against transformers' DeepseekV2Moe / DeepseekV3MoE (tiny, random, fp32)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3ForCausalLM,
    DeepseekV3MoE,
)

from flashpage.config import ModelConfig
from flashpage.layers.moe import (
    SYNC_FREE_MAX_TOKENS,
    DeepseekMoE,
    FusedExperts,
    routing_method,
    set_fused_moe,
)

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=24,
              max_position_embeddings=128)


def v2_config(**kw) -> DeepseekV2Config:
    args = dict(COMMON, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                routed_scaling_factor=1.5)
    args.update(kw)
    return DeepseekV2Config(**args)


def v3_config(**kw) -> DeepseekV3Config:
    args = dict(COMMON, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    args.update(kw)
    return DeepseekV3Config(**args)


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)


def ours_from(hf_module: torch.nn.Module, hf_config, path: str = "sync_free") -> DeepseekMoE:
    """Our MoE with HF's weights, forced onto one expert path whatever the token count."""
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    ours = DeepseekMoE(cfg)
    ours.load_state_dict(hf_module.state_dict(), strict=True)
    ours.experts.sync_free_max_tokens = 10**9 if path == "sync_free" else -1
    return ours


PATHS = pytest.mark.parametrize("path", ["sync_free", "grouped"])


def assert_same(ours: torch.nn.Module, hf: torch.nn.Module, hidden: int, seed: int) -> None:
    x = torch.randn(3, 41, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = hf(x)
        got = ours(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(topk_method="greedy"),
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
        dict(topk_method="greedy", n_shared_experts=0, num_experts_per_tok=1),
    ],
    ids=["greedy", "group_limited", "no_shared_top1"],
)
@PATHS
def test_v2_moe_matches_hf(kw, path):
    conf = v2_config(**kw)
    hf = DeepseekV2Moe(conf).eval()
    randomize(hf, 0)
    ours = ours_from(hf, conf, path)
    assert routing_method(ours_cfg := ModelConfig.from_hf(conf.to_dict())) == kw["topk_method"]
    assert ours_cfg.scoring_func == "softmax"
    assert_same(ours, hf, conf.hidden_size, 1)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(norm_topk_prob=False, routed_scaling_factor=1.0),
        dict(n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=2),
    ],
    ids=["grouped", "unnormalised", "one_group"],
)
@PATHS
def test_v3_moe_matches_hf(kw, path):
    conf = v3_config(**kw)
    hf = DeepseekV3MoE(conf).eval()
    randomize(hf, 2)  # includes a non-zero e_score_correction_bias
    assert hf.gate.e_score_correction_bias.abs().sum() > 0
    ours = ours_from(hf, conf, path)
    assert ours.gate.method == "noaux_tc"
    assert_same(ours, hf, conf.hidden_size, 3)


def test_v3_correction_bias_changes_the_choice():
    """The bias steers which experts are chosen but not their weights: a test that ignored
    it would pass the comparison above only by luck, so check it matters here."""
    conf = v3_config()
    hf = DeepseekV3MoE(conf).eval()
    randomize(hf, 4)
    ours = ours_from(hf, conf)
    x = torch.randn(64, conf.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, ids_with = ours.gate(x)
        ours.gate.e_score_correction_bias.zero_()
        _, ids_without = ours.gate(x)
    assert not torch.equal(ids_with.sort(-1).values, ids_without.sort(-1).values)


def test_router_stays_fp32_and_bf16_runs():
    conf = v3_config()
    hf = DeepseekV3MoE(conf)
    randomize(hf, 6)
    ours = ours_from(hf, conf)
    w = ours.gate.weight.detach().clone()
    ours = ours.to(torch.bfloat16)
    assert ours.gate.weight.dtype == torch.float32
    assert ours.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.gate.weight, w)  # not rounded through bf16
    assert ours.experts.gate_up_proj.dtype == torch.bfloat16
    x = torch.randn(5, conf.hidden_size, dtype=torch.bfloat16)
    assert ours(x).dtype == torch.bfloat16


def test_loads_per_expert_checkpoint(tmp_path):
    """save_pretrained writes experts.{e}.gate_proj.weight etc.; the experts fuse on load."""
    conf = v3_config(first_k_dense_replace=1)
    torch.manual_seed(7)
    model = DeepseekV3ForCausalLM(conf).eval()
    randomize(model.model.layers[1].mlp, 8)
    model.save_pretrained(tmp_path)
    sd = load_file(os.path.join(tmp_path, "model.safetensors"))
    prefix = "model.layers.1.mlp."
    layer_sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    assert "experts.0.gate_proj.weight" in layer_sd  # the on-disk form really is per expert
    ours = DeepseekMoE(ModelConfig.from_hf(conf.to_dict()))
    ours.load_state_dict(layer_sd, strict=True)
    assert_same(ours, model.model.layers[1].mlp, conf.hidden_size, 9)


@PATHS
def test_experts_handle_unused_experts_and_empty_batch(path):
    conf = v2_config(n_routed_experts=16, num_experts_per_tok=1)
    hf = DeepseekV2Moe(conf).eval()
    randomize(hf, 10)
    ours = ours_from(hf, conf, path)
    assert_same(ours, hf, conf.hidden_size, 11)  # 123 tokens, most experts hit, maybe not all
    with torch.no_grad():
        x = torch.randn(2, conf.hidden_size)
        assert torch.allclose(ours(x), hf(x), atol=1e-5)  # at most 2 experts used
        assert ours(torch.empty(0, conf.hidden_size)).shape == (0, conf.hidden_size)


# ----------------------------------------------------------------- sync-free vs grouped
def random_experts(num_experts: int, hidden: int, inter: int, seed: int) -> FusedExperts:
    conf = v2_config(n_routed_experts=num_experts, hidden_size=hidden, moe_intermediate_size=inter)
    experts = FusedExperts(ModelConfig.from_hf(conf.to_dict()))
    randomize(experts, seed)
    return experts


def crowded_routing(n: int, k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (distinct within a token) drawn from a few popular experts, so that many
    tokens share an expert, plus random fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    popular = min(num_experts, k + 2)
    ids = torch.stack([torch.randperm(popular, generator=g)[:k] for _ in range(n)])
    ids[: n // 2] = torch.randperm(num_experts, generator=g)[:k]  # half the batch: one choice
    weights = torch.rand(n, k, generator=g) * 2
    return ids, weights


@pytest.mark.parametrize(
    ("n", "k", "num_experts", "sub_path"),
    [(1, 2, 16, "_gathered"), (2, 2, 16, "_gathered"), (3, 2, 16, "_all_experts"),
     (1, 3, 8, "_all_experts"), (37, 3, 8, "_all_experts"), (64, 6, 24, "_all_experts")],
)
def test_sync_free_path_equals_grouped(n, k, num_experts, sub_path, monkeypatch):
    experts = random_experts(num_experts, 32, 24, seed=n + k)
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1))
    ids, weights = crowded_routing(n, k, num_experts, seed=2)
    assert (ids[:, :1] == ids[0, 0]).sum() >= n // 2  # one expert picked by many tokens
    used = []
    original = getattr(FusedExperts, sub_path)

    def spy(self, *a):
        used.append(sub_path)
        return original(self, *a)

    monkeypatch.setattr(FusedExperts, sub_path, spy)
    with torch.no_grad():
        want = experts.forward_grouped(x, weights, ids)
        got = experts.forward_sync_free(x, weights, ids)
    assert used == [sub_path], "the expected sync-free variant did not run"
    assert got.shape == want.shape == (n, 32)
    # fp32; only the summation order inside the matmuls differs (outputs are O(10)).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_path_is_chosen_by_token_count(monkeypatch):
    experts = random_experts(8, 16, 8, seed=3)
    ran = []
    monkeypatch.setattr(FusedExperts, "forward_grouped", lambda self, *a: ran.append("grouped"))
    monkeypatch.setattr(FusedExperts, "forward_sync_free", lambda self, *a: ran.append("sync_free"))
    for n in (1, SYNC_FREE_MAX_TOKENS, SYNC_FREE_MAX_TOKENS + 1):
        ids = torch.zeros(n, 2, dtype=torch.long)
        experts(torch.zeros(n, 16), torch.zeros(n, 2), ids)
    assert ran == ["sync_free", "sync_free", "grouped"]


def test_sync_free_bf16_follows_grouped():
    """bf16: both paths round each weighted expert output to bf16 before the sum."""
    experts = random_experts(8, 64, 32, seed=4).to(torch.bfloat16)
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    ids, weights = crowded_routing(29, 3, 8, seed=6)
    with torch.no_grad():
        want = experts.forward_grouped(x, weights, ids).float()
        got = experts.forward_sync_free(x, weights, ids).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------- fused kernel path
# Triton runs on the GPU where there is one, else in its interpreter (tests/conftest.py).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("n", "k", "num_experts"),
    [(1, 2, 16), (3, 2, 16), (1, 6, 64), (37, 3, 8), (64, 6, 24)],
)
def test_fused_path_equals_sync_free_and_grouped(n, k, num_experts):
    """The Triton kernel (interpreter on the CPU) against both torch paths, fp32, with
    many tokens on one expert and, at 16+ experts, some experts unused."""
    experts = random_experts(num_experts, 32, 24, seed=n + k).to(DEV)
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1)).to(DEV)
    ids, weights = (t.to(DEV) for t in crowded_routing(n, k, num_experts, seed=2))
    with torch.no_grad():
        grouped = experts.forward_grouped(x, weights, ids)
        sync_free = experts.forward_sync_free(x, weights, ids)
        fused = experts.forward_fused(x, weights, ids)
    assert fused.shape == (n, 32)
    torch.testing.assert_close(fused, sync_free, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, grouped, rtol=1e-5, atol=1e-5)


def test_fused_path_is_chosen_by_token_count_when_on(monkeypatch):
    experts = random_experts(8, 16, 8, seed=3)
    assert not experts.fused_kernel  # off unless the engine turns it on
    moe = torch.nn.Sequential(experts)
    set_fused_moe(moe, True)
    assert experts.fused_kernel
    ran = []
    for name in ("forward_grouped", "forward_sync_free", "forward_fused"):
        monkeypatch.setattr(FusedExperts, name, lambda self, *a, name=name: ran.append(name))
    for n in (1, SYNC_FREE_MAX_TOKENS, SYNC_FREE_MAX_TOKENS + 1):
        experts(torch.zeros(n, 16), torch.zeros(n, 2), torch.zeros(n, 2, dtype=torch.long))
    assert ran == ["forward_fused", "forward_fused", "forward_grouped"]
    set_fused_moe(moe, False)
    experts(torch.zeros(1, 16), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long))
    assert ran[-1] == "forward_sync_free"


def test_v2_moe_with_fused_path_matches_hf():
    conf = v2_config(topk_method="greedy")
    hf = DeepseekV2Moe(conf).eval()
    randomize(hf, 0)
    ours = ours_from(hf, conf).to(DEV)
    set_fused_moe(ours, True)
    x = torch.randn(3, 41, conf.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)
        got = ours(x.to(DEV)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
