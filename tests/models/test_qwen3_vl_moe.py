"""Qwen3-VL-MoE's config and weights (config._qwen_vl_text_config's qwen3_vl_moe branch,
models/multimodal.qwen3_vl_moe_experts): the text model read as Qwen3-MoE (experts, dense
layers, top-k weights always renormalized as transformers' router does), Qwen3VLMoeTextConfig's
defaults for fields left out, the fused expert tensors in both layouts (transformers 5's
[E, 2I, H] and the published files' [E, H, 2I]) loaded equal, a shape fitting neither named,
and ``flashpage inspect``'s counts against transformers' (a tiny checkpoint, and the
published Qwen3-VL-30B-A3B config in benchmarks/configs). fp32, CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from flashpage.config import ModelConfig
from flashpage.inspect import inspect_config
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import edited_copy
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl, hf_qwen3_vl, hub_experts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)


def _model(path: Path):
    return load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_config_reads_a_qwen3_moe_text_model(tiny):
    cfg = ModelConfig.from_hf(tiny)
    assert (cfg.architecture, cfg.model_type, cfg.multimodal_architecture, cfg.qk_norm) == \
        ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3VLMoeForConditionalGeneration", True)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.intermediate_size, cfg.mlp_only_layers) == (4, 2, 24, 96, (1,))
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    # transformers 5 saved no norm_topk_prob (its router always renormalizes): nor do we skip it
    assert "norm_topk_prob" not in json.loads((tiny / "config.json").read_text())["text_config"]
    assert cfg.norm_topk_prob
    assert cfg.mrope_section == (4, 2, 2) and cfg.mrope_interleaved
    vc = cfg.vision
    assert vc is not None and vc.variant == "qwen3_vl" and vc.deepstack_visual_indexes == (1, 0)


def test_defaults_are_transformers(tiny):
    """A text_config naming only the sizes it must: the rest are Qwen3VLMoeTextConfig's."""
    raw = json.loads((tiny / "config.json").read_text())
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "model_type",
            "rope_parameters", "num_hidden_layers")
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k in keep}
    raw["vision_config"]["out_hidden_size"] = raw["text_config"]["hidden_size"]
    ours = ModelConfig.from_hf(raw)
    ref = transformers.Qwen3VLMoeTextConfig()
    assert (ours.vocab_size, ours.intermediate_size, ours.moe_intermediate_size, ours.n_routed_experts,
            ours.num_experts_per_tok, ours.decoder_sparse_step, ours.max_position_embeddings) == \
        (ref.vocab_size, ref.intermediate_size, ref.moe_intermediate_size, ref.num_experts,
         ref.num_experts_per_tok, ref.decoder_sparse_step, ref.max_position_embeddings)


def test_both_expert_layouts_load_equal(tiny, tmp_path):
    ours = dict(_model(tiny).named_parameters())
    hub = dict(_model(edited_copy(tiny, tmp_path / "hub", edit=hub_experts)).named_parameters())
    name = "model.layers.2.mlp.experts.gate_up_proj"
    assert ours[name].shape == (4, 48, 64) and ours[name.replace("gate_up", "down")].shape == (4, 64, 24)
    hf = hf_qwen3_vl(tiny)
    torch.testing.assert_close(ours[name], hf.model.language_model.layers[2].mlp.experts.gate_up_proj,
                               rtol=0, atol=0)
    assert ours.keys() == hub.keys() and all(torch.equal(ours[k], hub[k]) for k in ours)


def test_an_expert_shape_fitting_neither_layout_is_named(tiny, tmp_path):
    def cut(t):
        t["model.language_model.layers.0.mlp.experts.down_proj"] = \
            t["model.language_model.layers.0.mlp.experts.down_proj"][:, :, :20].contiguous()

    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj.*\(4, 64, 20\)"):
        _model(edited_copy(tiny, tmp_path / "bad", edit=cut))


def test_inspect_counts_equal_transformers(tiny):
    """The tiny checkpoint: the text model's parameters (experts, dense layer, untied head)
    and the tower's equal transformers' module counts."""
    hf = hf_qwen3_vl(tiny)
    info = inspect_config(ModelConfig.from_hf(tiny), 1 << 30, "fp32")
    tower = sum(p.numel() for p in hf.model.visual.parameters())
    assert info["vision"]["params"] == tower
    assert info["param_count"] == sum(p.numel() for p in hf.parameters()) - tower
    assert info["moe"]["experts"] == 4 and info["moe"]["moe_layers"] == 2


def test_published_qwen3_vl_30b_a3b():
    """benchmarks/configs/qwen3-vl-30b-a3b (the published config.json and
    preprocessor_config.json): transformers' meta-device model holds 31,070,754,032
    parameters, 538,631,408 of them the tower's (with its three deepstack mergers); ours
    count the same; a 1024 x 768 image is 768 tokens; 48 MoE layers of 128 experts, 8 a token."""
    path = ROOT / "benchmarks" / "configs" / "qwen3-vl-30b-a3b"
    info = inspect_config(ModelConfig.from_hf(str(path)), 140 << 30, image_size=(1024, 768))
    with torch.device("meta"):
        hf = transformers.Qwen3VLMoeForConditionalGeneration(transformers.AutoConfig.from_pretrained(path))
    tower = sum(p.numel() for p in hf.model.visual.parameters())
    assert tower == info["vision"]["params"] == 538_631_408
    assert info["param_count"] + tower == sum(p.numel() for p in hf.parameters()) == 31_070_754_032
    assert info["vision"]["image_tokens"] == (1024 // 32) * (768 // 32)
    assert (info["moe"]["experts"], info["moe"]["experts_per_token"], info["moe"]["moe_layers"]) == (128, 8, 48)
    assert 3.0e9 < info["active_param_count"] < 3.5e9  # "A3B"
