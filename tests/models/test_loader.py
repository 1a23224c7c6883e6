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


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's conversion of HF q/k rows (halves -> interleaved rope pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_rope_factors(base: float, dim: int, factor: float, low: float, high: float,
                         old_len: int) -> list[float]:
    """llama.cpp's rope_freqs for Llama 3.1 scaling: one divisor per frequency."""
    import math

    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _hf_to_gguf(src, path, arch: str, rope_factors: list[float] | None = None) -> None:
    """Write HF checkpoint ``src`` as an f32 GGUF the way llama.cpp converts it: Llama
    q/k rows permuted (not Qwen's), Llama 3.1 scaling as rope_freqs."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from flashpage.config import ModelConfig

    cfg = ModelConfig.from_hf(src)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name in top:
            out = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{per_layer[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
        w.add_tensor(out, t.float().numpy())
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name, arch", [("llama31_gqa", "llama"), ("qwen2_bias", "qwen2"),
                                        ("qwen3_qknorm", "qwen3")])
def test_gguf_conversions_equal_transformers(tiny_checkpoint, tmp_path, name, arch):
    """Checkpoints converted to GGUF as llama.cpp does (Llama: permuted q/k and Llama 3.1
    scaling as rope_freqs; Qwen2 with biases and Qwen3 with q/k norms: not permuted) give
    transformers' greedy tokens on the originals."""
    from flashpage import LLM, SamplingParams
    from flashpage.config import ModelConfig
    from tests.conftest import hf_greedy, random_prompts

    src = tiny_checkpoint(name)
    cfg = ModelConfig.from_hf(src)
    factors = None
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        assert rs.rope_type == "llama3"
        factors = _llama3_rope_factors(cfg.rope_theta, cfg.head_dim, rs.factor, rs.low_freq_factor,
                                       rs.high_freq_factor, rs.original_max_position_embeddings or 8192)
        assert any(f != 1.0 for f in factors)  # the scaling must matter at this size
    path = tmp_path / f"{name}.gguf"
    _hf_to_gguf(src, path, arch, factors)
    prompts = random_prompts(3, 20, 90, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = LLM(str(path), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(src, prompts, 12)
