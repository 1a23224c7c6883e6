"""moe_route (kernels/moe_router.py) against layers/moe.MoEGate's torch routing: the same
experts and the same weights for every token, under the interpreter on the CPU (fp32 is
all it computes in) and on the GPU; V2's greedy and group-limited routing, V3's noaux_tc
with its correction bias, groups of a size that is not a power of two."""

from __future__ import annotations

import pytest
import torch

from flashpage.config import ModelConfig
from flashpage.kernels.moe_router import moe_route
from flashpage.layers.moe import MoEGate

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"

CASES = {  # name: (model_type, topk_method, E, top_k, n_group, topk_group, norm, scale)
    "v2_greedy": ("deepseek_v2", "greedy", 64, 6, 1, 1, False, 1.0),
    "v2_group_limited": ("deepseek_v2", "group_limited_greedy", 160, 6, 8, 3, False, 16.0),
    "v3_noaux": ("deepseek_v3", "noaux_tc", 256, 8, 8, 4, True, 2.5),
    "v3_noaux_small": ("deepseek_v3", "noaux_tc", 16, 4, 4, 2, False, 1.0),
}


def _gate(case: str) -> MoEGate:
    model_type, method, e, k, groups, keep, norm, scale = CASES[case]
    cfg = ModelConfig(architecture="DeepseekV3ForCausalLM", model_type=model_type, vocab_size=32,
                      hidden_size=e, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=16, n_routed_experts=e, num_experts_per_tok=k,
                      moe_intermediate_size=8, topk_method=method, n_group=groups,
                      topk_group=keep, norm_topk_prob=norm, routed_scaling_factor=scale)
    gate = MoEGate(cfg).to(DEV)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(e))  # logits = x
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.copy_(torch.rand(e, generator=torch.Generator().manual_seed(e)) * 0.1)
    return gate


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("case", list(CASES))
def test_route_matches_the_torch_gate(case, tokens):
    gate = _gate(case)
    e = gate.num_experts
    logits = torch.randn(tokens, e, generator=torch.Generator().manual_seed(tokens + e)).to(DEV) * 2
    want_w, want_ids = gate(logits)
    got_w, got_ids = moe_route(logits, gate.top_k, gate.method, n_group=gate.n_group,
                               topk_group=gate.topk_group, norm_topk_prob=gate.norm_topk_prob,
                               scale=gate.routed_scaling_factor, bias=gate.e_score_correction_bias)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert got_ids.shape == got_w.shape == (tokens, gate.top_k)
    # Best first in ours; torch leaves the order open: compare sorted by expert id.
    want_order, got_order = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(got_order.values, want_order.values)
    torch.testing.assert_close(got_w.gather(1, got_order.indices), want_w.gather(1, want_order.indices),
                               rtol=1e-5, atol=1e-6)
    # Best first: the weights of V2 (softmax scores) fall along each row.
    if gate.method != "noaux_tc":
        assert (got_w[:, :-1] >= got_w[:, 1:]).all()


def test_route_rejects_bad_input():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="unknown routing method"):
        moe_route(x, 2, "sparsemixer")
    with pytest.raises(ValueError, match="contiguous fp32"):
        moe_route(x.half(), 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(x, 17)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        moe_route(x, 2, "group_limited_greedy", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="correction bias"):
        moe_route(x, 2, "noaux_tc", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="noaux_tc only"):
        moe_route(x, 2, bias=torch.zeros(16))


def test_moe_layer_routes_through_the_kernel_when_switched_on(monkeypatch):
    """DeepseekMoE with the router kernel allowed (set_fused_moe) and FLASHPAGE_FUSED_ROUTER=1
    calls moe_route and gives the torch routing's output; with the variable off it does not."""
    from unittest import mock

    import flashpage.kernels.moe_router as router
    from flashpage.layers.moe import DeepseekMoE, set_fused_moe

    model_type, method, e, k, groups, keep, norm, scale = CASES["v3_noaux_small"]
    cfg = ModelConfig(architecture="DeepseekV3ForCausalLM", model_type=model_type, vocab_size=32,
                      hidden_size=32, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=16, n_routed_experts=e, num_experts_per_tok=k,
                      moe_intermediate_size=8, topk_method=method, n_group=groups,
                      topk_group=keep, norm_topk_prob=norm, routed_scaling_factor=scale,
                      n_shared_experts=1)
    torch.manual_seed(0)
    moe = DeepseekMoE(cfg).to(DEV)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 32, device=DEV)
    monkeypatch.setenv("FLASHPAGE_FUSED_ROUTER", "1")
    plain = moe(x)  # fused_route not set: torch routing
    set_fused_moe(moe, False)  # the torch experts: the fused MoE kernel needs CUDA
    moe.gate.fused_route = True  # what set_fused_moe(moe, True) sets beside it
    with mock.patch.object(router, "moe_route", wraps=router.moe_route) as spy:
        routed = moe(x)
        assert spy.call_count == 1
        monkeypatch.setenv("FLASHPAGE_FUSED_ROUTER", "0")
        moe(x)
        assert spy.call_count == 1
    torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-6)
