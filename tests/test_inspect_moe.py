"""``flashpage inspect`` on Mixtral, Qwen2-MoE and Qwen3-MoE: published models' parameter
counts (total and active) and KV bytes from their configs, and, on tiny checkpoints, the
parameters and weight bytes (fp8 too) of the model the engine loads, exactly."""

from __future__ import annotations

import pytest
import torch

from flashpage.config import ModelConfig
from flashpage.inspect import format_report, inspect_config, param_counts
from flashpage.layers.moe import SparseMoeBlock
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import TINY_MOE_MODELS

MIXTRAL_8X7B = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
                    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=32768, sliding_window=None)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[])
QWEN15_MOE_A27B = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                       vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                       num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, norm_topk_prob=False)


@pytest.mark.parametrize(("raw", "total", "active", "kv_per_token"), [
    (MIXTRAL_8X7B, 46.7e9, 12.9e9, 2 * 8 * 128 * 2 * 32),  # Mistral AI's figures
    (QWEN3_30B_A3B, 30.5e9, 3.3e9, 2 * 4 * 128 * 2 * 48),  # Qwen's model card
    (QWEN15_MOE_A27B, 14.3e9, 2.7e9, 2 * 16 * 128 * 2 * 24),
], ids=["mixtral_8x7b", "qwen3_30b_a3b", "qwen1.5_moe_a2.7b"])
def test_inspect_counts_published_moe_models(raw, total, active, kv_per_token):
    info = inspect_config(ModelConfig.from_hf(raw), 80 << 30, "bf16")
    assert info["param_count"] == pytest.approx(total, rel=0.01)
    assert info["active_param_count"] == pytest.approx(active, rel=0.02)
    assert info["kv_bytes_per_token"] == kv_per_token
    moe = info["moe"]
    assert moe["experts"] == raw.get("num_experts", raw.get("num_local_experts"))
    assert moe["moe_layers"] == raw["num_hidden_layers"]
    report = format_report(info)
    assert f"{raw['num_experts_per_tok']} of {moe['experts']} per token" in report
    assert ("a shared MLP of 5632" in report) == ("shared_expert_intermediate_size" in raw)


@pytest.mark.parametrize("name", sorted(TINY_MOE_MODELS))
def test_inspect_param_count_is_the_models_own(tiny_moe_checkpoint, name):
    """What inspect counts from the config alone is what the model holds, exactly."""
    source = resolve_model(str(tiny_moe_checkpoint(name)))
    model = load_model(source, torch.float32, torch.device("cpu"))
    total, active = param_counts(source.config)
    assert total == sum(p.numel() for p in model.parameters())
    cfg = source.config
    idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert total - active == idle * sum(isinstance(layer.mlp, SparseMoeBlock)
                                        for layer in model.model.layers)


@pytest.mark.parametrize("name", sorted(TINY_MOE_MODELS))
def test_inspect_weight_bytes_equal_the_loaded_models_fp8_too(tiny_moe_checkpoint, name):
    """``flashpage inspect`` (with ``--quantization fp8`` too: attention, dense MLPs and the
    shared expert in e4m3; router, routed experts and shared-expert gate 16-bit) counts the
    bytes the engine's model holds, to the byte."""
    from flashpage.bench.common import weight_bytes

    path = tiny_moe_checkpoint(name)
    cfg = ModelConfig.from_hf(path)
    for q in (None, "fp8"):
        model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"),
                           quantization=q)
        assert inspect_config(cfg, 1 << 30, "fp32", quantization=q)["weights_bytes"] == \
            weight_bytes(model), q
        if q == "fp8":
            moe = model.model.layers[1].mlp
            assert moe.gate.weight.dtype == moe.experts.gate_up_proj.dtype == torch.float32
            assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
