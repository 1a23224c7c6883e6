"""GGUF files of Gemma 1/2/3, Phi-3, StarCoder2, Mixtral (under "llama"), Qwen2-MoE,
Qwen3-MoE, Command-R, Cohere2, OLMo, OLMo2, OLMoE, Granite, GraniteMoeShared, Phi-2,
GPT-NeoX, GPT-2, Falcon, Bloom, MPT, StarCoder (GPT-BigCode) and GPT-J, written from tiny
random transformers checkpoints the way llama.cpp's convert_hf_to_gguf.py writes them (its metadata keys, gguf-py's own tensor-name map, and
its changes to the values: Llama's (Granite's, OLMo's) permuted q/k, Granite MoE's split
input_linear, GPT-NeoX's, Falcon's and Bloom's qkv rows reordered, Bloom's tied head copied,
GPT-2's Conv1D weights transposed, Gemma's norms stored as 1 + w, experts
stacked per layer, Phi-3's rope factors as tensors), give transformers' greedy tokens on
the originals; the metadata llama.cpp decides without (Gemma's attention scale and window
pattern, Qwen-MoE's top-k normalization) is read as llama.cpp reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.models.common import regroup_qkv
from flashpage.models.gguf_config import gguf_to_hf_config
from tests.conftest import _save_tiny_routed, build_tiny_moe_checkpoint, hf_greedy, random_prompts

gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_GEMMA_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)
# Granite's multipliers; an attention scale large enough that q/k errors (a bias left
# permuted) change the tokens
_GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                logits_scaling=8.0)
# name -> (GGUF architecture, transformers config class, its fields). Each is what the
# converter can write and llama.cpp reads back: Gemma's query_pre_attn_scalar is head_dim
# (llama.cpp scales by it below the 27B sizes), Gemma 3 has 6 layers (every 6th global),
# StarCoder2 and Mixtral have no window (llama.cpp reads none for them), Qwen3-MoE has
# every layer MoE (no dense mlp_only_layers in llama.cpp's qwen3moe).
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gemma": ("gemma", "GemmaConfig", dict(_GEMMA_BASE, num_hidden_layers=2)),
    "gemma2": ("gemma2", "Gemma2Config", dict(
        _GEMMA_BASE, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
        attn_logit_softcapping=4.0, final_logit_softcapping=5.0)),
    "gemma3": ("gemma3", "Gemma3TextConfig", dict(
        _GEMMA_BASE, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16,
        sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Phi-4-mini's shape: 3/4 of each head rotated, longrope over an original 32 positions
    "phi3_longrope": ("phi3", "Phi3Config", dict(
        num_hidden_layers=2, num_key_value_heads=2, partial_rotary_factor=0.75,
        original_max_position_embeddings=32, rope_scaling=dict(
            type="longrope", short_factor=[1.0, 1.2, 1.5, 2.1, 2.9, 4.0],
            long_factor=[1.5, 2.8, 4.6, 7.5, 11.0, 16.0]))),
    # Phi-3-mini's: a window shorter than the prompts, a tied head
    "phi3_window_tied": ("phi3", "Phi3Config", dict(
        num_hidden_layers=2, num_key_value_heads=4, sliding_window=16, tie_word_embeddings=True)),
    "starcoder2": ("starcoder2", "Starcoder2Config", dict(
        num_hidden_layers=2, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=True)),
    # Command-R's shape (tied, logits x 1/4); Command-R+'s per-head q/k LayerNorms
    "command_r": ("command-r", "CohereConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, logit_scale=0.25, tie_word_embeddings=True)),
    "command_r_qk_norm": ("command-r", "CohereConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.8,
        layer_norm_eps=1e-3, tie_word_embeddings=True)),
    # Command R7B's layout: 3 sliding layers, then a global NoPE one (llama.cpp's fixed 4)
    "cohere2": ("cohere2", "Cohere2Config", dict(
        num_hidden_layers=4, num_key_value_heads=2, sliding_window=8, sliding_window_pattern=4,
        logit_scale=0.5, tie_word_embeddings=True)),
    # biased q/k/v/o: OlmoModel permutes the q/k weights but not their biases
    "olmo": ("olmo", "OlmoConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, clip_qkv=1.0, tie_word_embeddings=True,
        attention_bias=True)),
    "olmo2": ("olmo2", "Olmo2Config", dict(num_hidden_layers=2, num_key_value_heads=2)),
    # untied: a tied head at these multipliers repeats the last token
    # biased q/k/v/o: LlamaModel permutes the q/k biases as the weights
    "granite": ("granite", "GraniteConfig", dict(_GRANITE, num_hidden_layers=2,
                                                 num_key_value_heads=2, attention_bias=True)),
    # OLMoE's eps is the converter's fixed 1e-5 (OlmoeConfig's default)
    "olmoe": ("olmoe", "OlmoeConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, rms_norm_eps=1e-5)),
    "granitemoeshared": ("granitemoe", "GraniteMoeSharedConfig", dict(
        _GRANITE, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=32,
        num_local_experts=6, num_experts_per_tok=3, shared_intermediate_size=48)),
    # Phi-2's shape: half of each head rotated, biased head; the converter's 4 x hidden MLP
    "phi2": ("phi2", "PhiConfig", dict(num_hidden_layers=2, intermediate_size=256)),
    # Pythia's: a quarter of each head rotated, parallel residual (and GPT-NeoX-20B's not)
    "gptneox": ("gptneox", "GPTNeoXConfig", dict(num_hidden_layers=2, intermediate_size=256)),
    "gptneox_sequential": ("gptneox", "GPTNeoXConfig", dict(
        num_hidden_layers=2, intermediate_size=256, use_parallel_residual=False,
        rotary_pct=0.5, tie_word_embeddings=True)),
    "gpt2": ("gpt2", "GPT2Config", dict(num_hidden_layers=2)),
    # Falcon-7B's layer (MQA, one norm) and Falcon-40B's (GQA, ln_attn and ln_mlp)
    "falcon_7b": ("falcon", "FalconConfig", dict(num_hidden_layers=2, multi_query=True)),
    "falcon_40b": ("falcon", "FalconConfig", dict(
        num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=2)),
    # Bloom tied (the converter's output.weight a copy of token_embd) and untied with 6
    # heads (the slopes of 4, then every other of 8's)
    "bloom": ("bloom", "BloomConfig", dict(num_hidden_layers=2, hidden_size=128,
                                           tie_word_embeddings=True)),
    "bloom_6h": ("bloom", "BloomConfig", dict(num_hidden_layers=2, hidden_size=96,
                                              num_attention_heads=6)),
    # MPT-7B's layer: tied; 6 heads (MPT's odd-then-even slopes of 8), q/k/v clamped
    # (another alibi_bias_max: test_mpt_alibi_bias_max_and_clamp, transformers reads none)
    "mpt": ("mpt", "MptConfig", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "mpt_6h_clip": ("mpt", "MptConfig", dict(
        num_hidden_layers=2, hidden_size=96, num_attention_heads=6,
        attn_config=dict(clip_qkv=0.6))),
    # StarCoder 1 / SantaCoder: multi-query, learned positions, tied
    "starcoder": ("starcoder", "GPTBigCodeConfig", dict(
        num_hidden_layers=2, multi_query=True, tie_word_embeddings=True)),
    # GPT-J: a quarter of each head rotated (interleaved pairs), a biased head
    "gptj": ("gptj", "GPTJConfig", dict(num_hidden_layers=2, rotary_dim=4)),
}
MOE: dict[str, tuple[str, dict]] = {
    "mixtral": ("llama", dict(sliding_window=None)),
    "qwen2_moe": ("qwen2moe", {}),
    "qwen3_moe": ("qwen3moe", dict(mlp_only_layers=[])),
}


def _build(path: Path, name: str) -> Path:
    if name in MOE:
        return build_tiny_moe_checkpoint(path, name, **MOE[name][1])
    _, cls_name, fields = FAMILIES[name]
    src = _save_tiny_routed(path, cls_name, fields, 0, False)
    if cls_name.startswith("Gemma"):  # Gemma's (1 + w) norms: w near 0; small embeddings
        from safetensors.torch import load_file, save_file  # (tests/models/test_gemma.py)

        sd = load_file(str(src / "model.safetensors"))
        g = torch.Generator().manual_seed(1)
        for n, t in sd.items():
            if "norm" in n:
                sd[n] = torch.rand(t.shape, generator=g) - 0.5
            elif "embed" in n:
                sd[n] = torch.randn(t.shape, generator=g) * 0.02
        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    if cls_name in ("GPT2Config", "FalconConfig", "BloomConfig", "GPTBigCodeConfig", "GPTJConfig"):
        # LayerNorms named ln_*: 0.5-1.5 as
        # test_gpt2_bigcode's (conftest's builder widens only "norm" names)
        from safetensors.torch import load_file, save_file

        sd = load_file(str(src / "model.safetensors"))
        g = torch.Generator().manual_seed(1)
        for n, t in sd.items():
            if ".ln_" in n and n.endswith(".weight"):
                sd[n] = torch.rand(t.shape, generator=g) + 0.5
        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


_PERMUTED = ("llama", "granite", "granitemoe", "olmo")  # LlamaModel.permute's q/k


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rope halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(src: Path, path: Path, arch: str, fuse_gate_up_exps: bool = False,
            q8: bool = False) -> None:
    """Write HF checkpoint ``src`` as an f32 GGUF of ``arch`` as convert_hf_to_gguf.py does:
    its set_gguf_parameters keys for the family, its modify_tensors changes, gguf-py's
    tensor-name map (``fuse_gate_up_exps``: its --fuse-gate-up-exps; ``q8``: its
    --outtype q8_0, every matrix of whole 32-value rows blocks in Q8_0)."""
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf(src)
    hparams = json.loads((src / "config.json").read_text())
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n)
    # BloomModel: seq_length, else n_embed (sic)
    w.add_context_length(hparams.get("seq_length", cfg.hidden_size) if arch == "bloom"
                         else cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)  # 4 x hidden for Bloom, MPT, StarCoder, GPT-J
    w.add_head_count(cfg.num_attention_heads)
    if arch not in ("mpt", "gptj"):  # MPTModel: only attn_config.kv_n_heads; GPTJModel: none
        w.add_head_count_kv(cfg.num_key_value_heads)  # StarCoderModel: 1 (multi_query only)
    if arch == "mpt":  # MPTModel: a fixed eps, the ALiBi bias, the clamp when set
        w.add_layer_norm_eps(1e-5)
        w.add_max_alibi_bias(hparams["attn_config"]["alibi_bias_max"])
        if cfg.clip_qkv:
            w.add_clamp_kqv(cfg.clip_qkv)
    elif arch == "gptj":  # GPTJModel: the rotated dims when not the whole head
        w.add_layer_norm_eps(cfg.rms_norm_eps)
        if cfg.rotary_dim < cfg.head_dim:
            w.add_rope_dimension_count(cfg.rotary_dim)
    elif arch in ("starcoder2", "command-r", "cohere2", "phi2", "gptneox", "gpt2", "falcon",
                  "bloom", "starcoder"):
        # TextModel: norm_epsilon / layer_norm_eps (ours holds either as rms_norm_eps)
        w.add_layer_norm_eps(cfg.rms_norm_eps)
    elif arch == "olmo":
        w.add_layer_norm_eps(1e-5)  # OlmoModel's fixed eps (OLMo's norms have no weights)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch.startswith("gemma") or cfg.model_type == "qwen3_moe":  # config.json's head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch not in ("gemma", "gemma2", "phi2", "gptneox", "gpt2", "falcon", "bloom", "mpt",
                    "starcoder", "gptj"):  # no rope base
        w.add_rope_freq_base(cfg.rope_theta)
    if arch in ("llama", "granite", "granitemoe", "cohere2"):  # LlamaModel (GraniteModel is one), Cohere2Model
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)  # Cohere2: rotary_pct 1.0 of the head
    if arch in ("command-r", "cohere2"):
        w.add_logit_scale(cfg.logit_scale)
    if arch == "cohere2":
        w.add_sliding_window(cfg.sliding_window)
    if arch in ("phi2", "gptneox"):  # Phi2Model / GPTNeoXModel: the rotated dims of a head
        w.add_rope_dimension_count(int(cfg.partial_rotary_factor * cfg.head_dim))
    if arch == "gptneox":
        w.add_parallel_residual(cfg.use_parallel_residual)
    if arch == "olmo" and cfg.clip_qkv:
        w.add_clamp_kqv(cfg.clip_qkv)
    if arch.startswith("granite"):  # GraniteModel: each multiplier under llama.cpp's name
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if cfg.n_routed_experts:  # TextModel; Qwen2MoeModel
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch.startswith("qwen"):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        assert cfg.rope_scaling is not None and cfg.rope_local_theta is not None
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        rs = cfg.rope_scaling
        rot = int(cfg.partial_rotary_factor * cfg.hidden_size) // cfg.num_attention_heads
        w.add_rope_scaling_orig_ctx_len(rs.original_max_position_embeddings if rs else 4096)
        w.add_rope_dimension_count(rot)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rs is not None:  # Phi3MiniModel.generate_extra_tensors
            scale = cfg.max_position_embeddings / rs.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                np.sqrt(1 + np.log(scale) / np.log(rs.original_max_position_embeddings)))
            w.add_tensor("rope_factors_long.weight", np.asarray(rs.long_factor, np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rs.short_factor, np.float32))

    names = gguf.get_tensor_name_map(next(a for a, s in gguf.MODEL_ARCH_NAMES.items() if s == arch), n)
    sd = load_file(str(src / "model.safetensors"))
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        if name == "lm_head.weight" and (arch in ("gemma", "gemma2") or cfg.tie_word_embeddings):
            continue  # skipped: their head is the embeddings
        # LlamaModel permutes the q/k biases too, OlmoModel the weights only
        kinds = ("weight",) if arch == "olmo" else ("weight", "bias")
        if arch in _PERMUTED and name.endswith(tuple(f"q_proj.{k}" for k in kinds)):
            t = _permute(t, cfg.num_attention_heads)
        elif arch in _PERMUTED and name.endswith(tuple(f"k_proj.{k}" for k in kinds)):
            t = _permute(t, cfg.num_key_value_heads)
        if arch == "gptneox" and "query_key_value" in name:  # GPTNeoXModel: [q; k; v]
            t = regroup_qkv(t, cfg.num_attention_heads, cfg.head_dim, to_ours=True)
        if arch == "bloom":  # BloomModel: names without transformer., [q; k; v], and the
            name = name.removeprefix("transformer.")  # tied embeddings written as output too
            if "query_key_value" in name:
                t = regroup_qkv(t, cfg.num_attention_heads, cfg.head_dim, to_ours=True)
            if name == "word_embeddings.weight" and "lm_head.weight" not in sd:
                _add(w, "output.weight", t, q8)
        if arch == "falcon" and "query_key_value" in name:  # FalconModel: [q; k; v]
            t = regroup_qkv(t, cfg.num_key_value_heads, cfg.head_dim, to_ours=True)
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t().contiguous()  # GPT2Model: Conv1D's [in, out] transposed
        if name.endswith("input_linear.weight"):  # GraniteMoeModel: gate and up rows apart
            gate, up = t.split(t.shape[-2] // 2, dim=-2)
            kinds = ("exps", "exps") if "block_sparse_moe" in name else ("shexp", "shexp")
            bid = name.split(".")[2]
            for proj, part, kind in (("gate", gate, kinds[0]), ("up", up, kinds[1])):
                w.add_tensor(f"blk.{bid}.ffn_{proj}_{kind}.weight", part.contiguous().numpy())
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1
        if ".experts." in name:  # stacked per layer: [experts, out, in]
            parts = name.split(".")
            proj = parts[-2]
            experts.setdefault((int(parts[2]), proj), {})[int(parts[-3])] = t
            continue
        _add(w, names.get_name(name, try_suffixes=(".weight", ".bias")), t, q8)
    stacked = {key: torch.stack([d[e] for e in sorted(d)]) for key, d in experts.items()}
    for (bid, proj), t in stacked.items():
        if arch == "llama":  # Mixtral: layers.{bid}.feed_forward.experts.w{1,2,3}
            hf = f"layers.{bid}.feed_forward.experts.{proj}.weight"
        else:
            hf = f"model.layers.{bid}.mlp.experts.{proj}.weight"
        gate = proj in ("w1", "gate_proj")
        if fuse_gate_up_exps and (gate or proj in ("w3", "up_proj")):
            if gate:
                up = stacked[(bid, "w3" if arch == "llama" else "up_proj")]
                w.add_tensor(f"blk.{bid}.ffn_gate_up_exps.weight", torch.cat([t, up], 1).numpy())
            continue
        w.add_tensor(names.get_name(hf, try_suffixes=(".weight",)), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _q8able(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.shape[1] % 32 == 0


def _add(w, name: str, t: torch.Tensor, q8: bool) -> None:
    """Tensor ``t`` into GGUF writer ``w``: f32, or Q8_0 (``q8``) where its rows are whole
    blocks."""
    a = t.float().contiguous().numpy()
    if q8 and _q8able(t):
        q = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
    else:
        w.add_tensor(name, a)


@pytest.mark.parametrize("name", [*FAMILIES, *MOE])
def test_conversions_equal_transformers(tmp_path, name):
    src = _build(tmp_path / "hf", name)
    arch = MOE[name][0] if name in MOE else FAMILIES[name][0]
    path = tmp_path / f"{name}.gguf"
    convert(src, path, arch, fuse_gate_up_exps=name == "qwen3_moe")
    # past the windows (8, 16) and Phi-3's original 32 positions (its long factors)
    prompts = random_prompts(2, 34, 50, seed=3)
    got = LLM(str(path), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native").generate(prompts, GREEDY, use_tqdm=False)
    want = hf_greedy(src, prompts, GREEDY.max_tokens, attn_implementation="eager")
    assert [o.outputs[0].token_ids for o in got] == want
    assert len({t for toks in want for t in toks}) > 4  # not one token repeated


def _metadata_only(path: Path, arch: str, layers: int, **keys) -> dict:
    """gguf_to_hf_config of a file with ``arch``'s common keys and ``keys`` (``{arch}.``
    dropped from their names: attention__scale -> {arch}.attention.scale)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(2048)
    w.add_feed_forward_length(4096)
    w.add_head_count(16)
    w.add_head_count_kv(8)
    w.add_key_length(256)
    w.add_vocab_size(256)
    for k, v in keys.items():
        key = f"{arch}.{k.replace('__', '.')}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        else:
            w.add_float32(key, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_to_hf_config(path)


def test_metadata_llama_cpp_decides(tmp_path):
    """Gemma 2/3's attention scale: llama.cpp's hidden / heads for the 27B sizes (46, 62
    layers), else head_dim, else the file's attention.scale; Gemma 3's windows every 6th
    layer global, none without a window, its local rope base 10000 unless given; Qwen-MoE's
    top-k normalization by architecture unless expert_weights_norm says."""
    def cfg(arch: str, layers: int, **keys) -> dict:
        return _metadata_only(tmp_path / f"{arch}{layers}{sorted(keys)}.gguf", arch, layers, **keys)

    assert cfg("gemma2", 46)["query_pre_attn_scalar"] == 2048 // 16
    assert cfg("gemma2", 26)["query_pre_attn_scalar"] == 256
    assert cfg("gemma3", 62)["query_pre_attn_scalar"] == 2048 // 16
    assert cfg("gemma3", 62, attention__scale=0.25)["query_pre_attn_scalar"] == 16.0
    g2 = cfg("gemma2", 26)
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (50.0, 30.0)
    g3 = cfg("gemma3", 12, attention__sliding_window=512)
    assert g3["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert g3["sliding_window"] == 512 and g3["rope_local_base_freq"] == 10000.0
    assert ModelConfig.from_hf(g3).layer_types == tuple(g3["layer_types"])
    g3 = cfg("gemma3", 12, rope__freq_base_swa=20000.0)
    assert g3["sliding_window"] is None and set(g3["layer_types"]) == {"full_attention"}
    assert g3["rope_local_base_freq"] == 20000.0
    moe = dict(expert_count=8, expert_used_count=2, expert_feed_forward_length=64)
    assert cfg("qwen2moe", 2, **moe)["norm_topk_prob"] is False
    assert cfg("qwen3moe", 2, **moe)["norm_topk_prob"] is True
    assert cfg("qwen3moe", 2, **moe, expert_weights_norm=False)["norm_topk_prob"] is False
    assert ModelConfig.from_hf(cfg("llama", 2, **moe)).architecture == "MixtralForCausalLM"
    assert ModelConfig.from_hf(cfg("llama", 2)).architecture == "LlamaForCausalLM"
    # Cohere2: llama.cpp's fixed pattern, every 4th layer global
    c2 = cfg("cohere2", 8, attention__sliding_window=512, logit_scale=0.25)
    assert c2["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    assert (c2["sliding_window"], c2["logit_scale"]) == (512, 0.25)
    with pytest.raises(ConfigError, match=r"cohere2.rope.dimension_count 64 \(a partial rotary\)"):
        cfg("cohere2", 4, attention__sliding_window=8, logit_scale=0.25, rope__dimension_count=64)
    # Granite: an absent attention scale is llama.cpp's 1 / sqrt(head_dim), the rest 1
    gr = cfg("granite", 2)
    assert gr["attention_multiplier"] == 128 ** -0.5
    assert (gr["embedding_multiplier"], gr["residual_multiplier"], gr["logits_scaling"]) == (1, 1, 1)
    gm = cfg("granitemoe", 2, **moe)
    assert gm["architectures"] == ["GraniteMoeForCausalLM"] and gm["num_local_experts"] == 8
    gm = cfg("granitemoe", 2, **moe, expert_shared_feed_forward_length=96)
    assert gm["architectures"] == ["GraniteMoeSharedForCausalLM"]
    assert gm["shared_intermediate_size"] == 96
    assert cfg("olmoe", 2, **moe)["norm_topk_prob"] is False
    with pytest.raises(ConfigError, match="OLMo 3's sliding layers"):
        cfg("olmo2", 2, attention__sliding_window=4096)
    # Falcon: more than one KV head with one norm is Falcon2-11B's new decoder layer
    f = cfg("falcon", 2)
    assert (f["new_decoder_architecture"], f["num_kv_heads"], f["num_ln_in_parallel_attn"]) == (
        True, 8, 1)
    with pytest.raises(ConfigError, match="GGUF architecture 'baichuan' is not supported"):
        cfg("baichuan", 2)


def test_unknown_tensor_names_its_architecture(tmp_path):
    from flashpage.models.loader import ModelLoadError, load_model, resolve_model

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "gemma")
    for k, v in dict(block_count=1, embedding_length=64, feed_forward_length=128,
                     attention__head_count=4, vocab_size=32).items():
        w.add_uint32(f"gemma.{k.replace('__', '.')}", v)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.add_tensor("blk.0.attn_sinks.weight", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unknown GGUF tensor 'blk.0.attn_sinks.weight' "
                                             r"\(architecture 'gemma'\)"):
        load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_moe_sizes_from_the_tensors_without_their_keys(tmp_path):
    """A Qwen2-MoE file without expert_(shared_)feed_forward_length: the experts' and the
    shared expert's sizes are their tensors' rows."""
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    for k, v in dict(block_count=1, embedding_length=64, feed_forward_length=128, vocab_size=32,
                     attention__head_count=4, expert_count=4, expert_used_count=2).items():
        w.add_uint32(f"qwen2moe.{k.replace('__', '.')}", v)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 24, 64), np.float32))
    w.add_tensor("blk.0.ffn_up_shexp.weight", np.zeros((40, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = gguf_to_hf_config(path)
    assert (d["moe_intermediate_size"], d["shared_expert_intermediate_size"]) == (24, 40)


def test_tokenizer_of_an_architecture_transformers_does_not_read(tmp_path, monkeypatch):
    """transformers' AutoTokenizer refuses a GGUF of an architecture whose config it does not
    read (command-r here); the tokenizer is still built from the file's vocabulary, equal
    to the one AutoTokenizer builds from the same vocabulary under qwen2, chat template kept."""
    from flashpage.engine.tokenizer import load_tokenizer
    from flashpage.models.loader import resolve_model

    monkeypatch.setenv("FLASHPAGE_CACHE_DIR", str(tmp_path / "cache"))
    tokens = ["a", "b", "c", "ab", "abc", "<s>", "</s>", "Ġ", "Ġab"]
    toks = {}
    for arch in ("qwen2", "command-r"):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(1)
        w.add_embedding_length(64)
        w.add_feed_forward_length(128)
        w.add_head_count(4)
        w.add_logit_scale(0.25)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * 5 + [3, 3] + [1] * 2)
        w.add_token_merges(["a b", "ab c", "Ġ ab"])
        w.add_bos_token_id(5)
        w.add_eos_token_id(6)
        w.add_chat_template("{{ messages[0]['content'] }}</s>")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if arch == "command-r":
            from transformers import AutoTokenizer

            with pytest.raises(ValueError, match="command-r is not supported"):
                AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        toks[arch] = load_tokenizer(resolve_model(str(path)))
    text = "abc ab cab"
    ids = toks["command-r"](text).input_ids
    assert ids == toks["qwen2"](text).input_ids and 4 in ids and 8 in ids
    assert toks["command-r"].eos_token == "</s>"
    chat = toks["command-r"].apply_chat_template([{"role": "user", "content": "ab"}],
                                                 tokenize=False)
    assert chat == "ab</s>"


def test_mpt_alibi_bias_max_and_clamp(tmp_path):
    """MPT's attention.max_alibi_bias is its ALiBi's alibi_bias_max and clamp_kqv its
    clip_qkv: a file from a checkpoint with alibi_bias_max 16 gives our tokens on that
    checkpoint (read as MosaicML's code and llama.cpp read it), not transformers' (whose
    MPT slopes are always alibi_bias_max 8's)."""
    fields = dict(FAMILIES["mpt_6h_clip"][2], attn_config=dict(alibi_bias_max=16, clip_qkv=0.6))
    src = _save_tiny_routed(tmp_path / "hf", "MptConfig", fields, 0, False)
    path = tmp_path / "mpt.gguf"
    convert(src, path, "mpt")
    d = gguf_to_hf_config(path)
    assert d["attn_config"] == {"alibi_bias_max": 16.0, "clip_qkv": pytest.approx(0.6)}
    cfg = ModelConfig.from_hf(d)
    assert (cfg.alibi_bias_max, cfg.clip_qkv, cfg.attention_bias) == (16.0, pytest.approx(0.6), False)
    prompts = random_prompts(2, 34, 50, seed=3)

    def ours(model: Path) -> list[list[int]]:
        llm = LLM(str(model), dtype="float32", device="cpu", block_size=8,
                  attention_backend="torch_native")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    got = ours(path)
    assert got == ours(src)
    assert got != hf_greedy(src, prompts, GREEDY.max_tokens, attn_implementation="eager")


def _gpt_file(path: Path, arch: str, drop: tuple[str, ...] = (),
              tensors: dict[str, np.ndarray] | None = None, **keys) -> dict:
    """gguf_to_hf_config of a file with the keys ``arch``'s converter class writes (Bloom,
    MPT, StarCoder, GPT-J: hidden 64, 4 heads, a 4 x 64 MLP), less ``drop``, with ``keys``
    (``{arch}.`` dropped from their names, __ for .) and ``tensors`` added."""
    base = dict(block_count=2, context_length=128, embedding_length=64, feed_forward_length=256,
                attention__head_count=4, vocab_size=32, attention__layer_norm_epsilon=1e-5)
    if arch in ("bloom", "starcoder"):
        base["attention__head_count_kv"] = 4 if arch == "bloom" else 1
    if arch == "mpt":
        base["attention__max_alibi_bias"] = 8.0
    base.update(keys)
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in base.items():
        if k in drop:
            continue
        key = f"{arch}.{k.replace('__', '.')}"
        if isinstance(v, float):
            w.add_float32(key, v)
        else:
            w.add_uint32(key, v)
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_to_hf_config(path)


@pytest.mark.parametrize("arch", ["bloom", "mpt", "starcoder", "gptj"])
def test_gpt_families_metadata_errors_name_the_key(tmp_path, arch):
    """What llama.cpp requires of these files (the LayerNorm eps; MPT's max_alibi_bias) is a
    ConfigError naming the key when absent; a MLP not 4 x hidden (what the converters write
    and the models build) too."""
    def cfg(name: str, **kw) -> dict:
        return _gpt_file(tmp_path / f"{name}.gguf", arch, **kw)

    assert ModelConfig.from_hf(cfg("ok")).num_hidden_layers == 2
    with pytest.raises(ConfigError, match=f"lacks {arch}.attention.layer_norm_epsilon"):
        cfg("eps", drop=("attention__layer_norm_epsilon",))
    with pytest.raises(ConfigError, match=rf"{arch}.feed_forward_length 128 is not supported.*"
                                          r"4 x embedding_length \(256\)"):
        cfg("ffn", feed_forward_length=128)


def test_gpt_families_metadata(tmp_path):
    """Bloom: tied when output.weight is absent or token_embd's bytes (BloomModel's copy),
    untied when it differs. MPT: max_alibi_bias absent or 0 (no ALiBi), grouped KV heads and
    q/k norms (qk_ln) are ConfigErrors naming them; biases (no_bias false) when the file has
    them. StarCoder: multi-query only. GPT-J: the rotated dims (the whole head without the
    key), base 10000 only."""
    def cfg(name: str, arch: str, **kw) -> dict:
        return _gpt_file(tmp_path / f"{name}.gguf", arch, **kw)

    emb = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    assert cfg("b0", "bloom")["tie_word_embeddings"] is True
    bloom = cfg("b1", "bloom", tensors={"token_embd.weight": emb, "output.weight": emb.copy()})
    assert bloom["tie_word_embeddings"] is True
    assert ModelConfig.from_hf(bloom).tie_word_embeddings
    bloom = cfg("b2", "bloom", tensors={"token_embd.weight": emb, "output.weight": emb + 1})
    assert bloom["tie_word_embeddings"] is False
    c = ModelConfig.from_hf(bloom)
    assert (c.alibi, c.alibi_bias_max, c.intermediate_size, c.max_position_embeddings) == (
        True, None, 256, 128)

    mpt = ModelConfig.from_hf(cfg("m0", "mpt"))
    assert (mpt.alibi_bias_max, mpt.clip_qkv, mpt.attention_bias) == (8.0, None, False)
    mpt = ModelConfig.from_hf(cfg("m1", "mpt", attention__clamp_kqv=8.0, tensors={
        "blk.0.attn_qkv.bias": np.zeros(192, np.float32)}))
    assert (mpt.clip_qkv, mpt.attention_bias, mpt.mlp_bias) == (8.0, True, True)
    with pytest.raises(ConfigError, match="lacks mpt.attention.max_alibi_bias"):
        cfg("m2", "mpt", drop=("attention__max_alibi_bias",))
    with pytest.raises(ConfigError, match=r"mpt.attention.max_alibi_bias 0.0 is not supported"):
        cfg("m3", "mpt", attention__max_alibi_bias=0.0)
    with pytest.raises(ConfigError, match="mpt.attention.head_count_kv 2"):
        cfg("m4", "mpt", attention__head_count_kv=2)
    with pytest.raises(ConfigError, match=r"tensor blk.0.attn_q_norm.weight \(MPT's qk_ln\)"):
        cfg("m5", "mpt", tensors={"blk.0.attn_q_norm.weight": np.ones(64, np.float32)})

    sc = ModelConfig.from_hf(cfg("s0", "starcoder"))
    assert (sc.architecture, sc.num_key_value_heads, sc.hidden_act, sc.learned_positions) == (
        "GPTBigCodeForCausalLM", 1, "gelu_pytorch_tanh", True)
    assert sc.max_position_embeddings == 128
    with pytest.raises(ConfigError, match="starcoder.attention.head_count_kv 4 is not supported"):
        cfg("s1", "starcoder", attention__head_count_kv=4)

    assert ModelConfig.from_hf(cfg("j0", "gptj")).rotary_dim == 16
    j = ModelConfig.from_hf(cfg("j1", "gptj", rope__dimension_count=8, rope__freq_base=10000.0))
    assert (j.rotary_dim, j.rope_interleaved, j.lm_head_bias) == (8, True, True)
    with pytest.raises(ConfigError, match="gptj.rope.freq_base 20000.0 is not supported"):
        cfg("j2", "gptj", rope__freq_base=20000.0)


@pytest.mark.parametrize("name", ["bloom", "starcoder"])
def test_q8_0_conversions_equal_transformers(tmp_path, name):
    """A Q8_0 file (--outtype q8_0: every matrix, embeddings and Bloom's copied head too) gives
    transformers' tokens on the checkpoint with its matrices rounded to Q8_0 as well (each
    row's blocks: the same whatever the converter's row reordering), Bloom's head still read
    as tied (its quantized bytes are token_embd's)."""
    from safetensors.torch import load_file, save_file

    src = _build(tmp_path / "hf", name)
    sd = load_file(str(src / "model.safetensors"))
    q = gguf.GGMLQuantizationType.Q8_0
    for n, t in sd.items():
        if _q8able(t):
            sd[n] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q), q))
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    path = tmp_path / f"{name}.gguf"
    convert(src, path, FAMILIES[name][0], q8=True)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["token_embd.weight"] == types["blk.1.attn_qkv.weight"] == "Q8_0"
    assert gguf_to_hf_config(path)["tie_word_embeddings"] is True
    prompts = random_prompts(2, 34, 50, seed=3)
    got = LLM(str(path), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native").generate(prompts, GREEDY, use_tqdm=False)
    want = hf_greedy(src, prompts, GREEDY.max_tokens, attn_implementation="eager")
    assert [o.outputs[0].token_ids for o in got] == want
    assert len({t for toks in want for t in toks}) > 4
