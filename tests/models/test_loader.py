"""Loader: fp32 tensors survive a bf16 model, and every persistent tensor must be loaded."""

from __future__ import annotations

import shutil

import pytest
import torch

from flashpage.layers.rotary import build_cos_sin_cache, scaled_inv_freq
from flashpage.models.loader import ModelLoadError, load_model, resolve_model


def test_rotary_cache_stays_exact_fp32_in_a_bf16_model(tiny_checkpoint):
    src = resolve_model(str(tiny_checkpoint("llama31_gqa")))
    model = load_model(src, torch.bfloat16, torch.device("cpu"), max_positions=512)
    cfg = src.config
    want = build_cos_sin_cache(scaled_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling), 512)
    rope = model.model.layers[0].self_attn.rotary_emb
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert rope.cos_sin_cache.dtype == torch.float32
    assert torch.equal(rope.cos_sin_cache, want)  # a bf16 round trip would change it


def test_missing_persistent_buffer_is_an_error(tmp_path, tiny_mla_checkpoint):
    from safetensors.torch import load_file, save_file

    src = tiny_mla_checkpoint("deepseek_v3")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    sd = load_file(str(src / "model.safetensors"))
    dropped = [k for k in sd if k.endswith("e_score_correction_bias")]
    assert dropped, "the V3 checkpoint should carry the router's correction bias"
    del sd[dropped[0]]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="e_score_correction_bias"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))


def test_merged_projections_round_trip_hf_names(tiny_checkpoint):
    """q/k/v and gate/up load into qkv_proj / gate_up_proj slices and come back unchanged."""
    from safetensors.torch import load_file

    path = tiny_checkpoint("qwen2_bias")  # with q/k/v biases
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    theirs = load_file(str(path / "model.safetensors"))
    ours = dict(model.hf_weights())
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_gguf_rope_frequency_factors_are_refused(tmp_path):
    """A GGUF carrying rope_freqs (how llama.cpp stores Llama 3.1 scaling) must not load
    as if it had none."""
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 256),
                       (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_freq_base, 500000.0), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_vocab_size, 32)]:
        add(value)
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_tensor("token_embd.weight", np.ones((32, 64), dtype=np.float32))
    w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
