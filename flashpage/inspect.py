"""``flashpage inspect``: what a model's KV cache costs, from its config alone.

For a ``config.json`` (or its folder) or a GGUF file, report the attention kind, the
head counts and dims, the KV bytes per token (per layer and over all layers), the
reduction against the MHA form of the same model, and how many tokens fit in a given
amount of memory. Nothing is loaded but the config.

Definitions (each figure can be checked by hand):

* KV values per token per layer: ``2 * num_kv_heads * head_dim`` for MHA/MQA/GQA;
  ``kv_lora_rank + qk_rope_head_dim`` for MLA (one latent, shared by all heads).
* The MHA form of a model caches K and V for every query head: ``2 * heads * head_dim``;
  for MLA, the K and V that prefill expands the latent into:
  ``heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)``.
  DeepSeek-V3 in bf16: 128 * (192 + 128) * 2 B = 81,920 B against 576 * 2 = 1,152 B, 71.1x.
* Equivalent GQA groups of MLA (DeepSeek-V2 paper, Table 1): MLA caches
  ``d_c + d_h^R`` values per token per layer, GQA with ``n_g`` groups caches
  ``2 * n_g * d_h``; so ``n_g = (kv_lora_rank + qk_rope_head_dim) / (2 * qk_nope_head_dim)``
  with the paper's per-head dim ``d_h = qk_nope_head_dim``. DeepSeek-V2 and V3:
  d_c = 4 d_h = 512, d_h^R = d_h / 2 = 64, d_h = 128: (512 + 64) / 256 = 2.25.
* Tokens in memory: ``memory // kv_bytes_per_token``, the KV cache alone; the same
  after subtracting the weights' size (``param_count * dtype bytes``; fp8 / int4 weights
  and GPT-OSS's MXFP4 experts at what the engine holds), clamped at 0.
* Parameters are counted from the config: embeddings (GPT-2's and OPT's learned positions,
  OPT-350m's project_in / project_out too), attention (MLA's low-rank
  projections and norms included), MLP (MoE routed and shared experts, router,
  Qwen2-MoE's shared-expert gate), norms, and the LM head unless tied. Active per token:
  the same with ``num_experts_per_tok`` routed experts in each MoE layer (Mixtral-8x7B:
  46.7B, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B; Qwen1.5-MoE-A2.7B: 14.3B, 2.7B). DeepSeek-V3's multi-token-prediction layers
  (``num_nextn_predict_layers``) are not part of the model that serves, and are left
  out: 671B for V3, as its paper counts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from flashpage import envs
from flashpage.config import (
    ONLINE_INT4_METHODS,
    CheckpointQuantization,
    ConfigError,
    ModelConfig,
    check_quantization,
    dtype_bytes,
    int4_group_for,
    online_int4_group_size,
)

DEFAULT_MEMORY = "80GiB"
DEFAULT_DTYPE = "bf16"
DEFAULT_IMAGE_SIZE = (1024, 768)  # an example image for an image model's figures (a 4:3 photo)

# Binary for K/M/G/T, KiB/MiB/GiB/TiB and the bare letters (K, M, G, T: what
# accelerator specs mean, "141G" of HBM is 141 GiB); decimal for KB/MB/GB/TB.
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p] = _UNITS[f"{_p}ib"] = 1024**_i
    _UNITS[f"{_p}b"] = 1000**_i
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")



def _kv_groups(cfg: ModelConfig, kv_per_layer: int, memory_bytes: int) -> dict[str, int] | None:
    """What the engine's KV cache groups hold for a model whose layers mix one window with
    full attention (kv_cache/hybrid.group_layers); None where one table serves all layers."""
    from flashpage.kv_cache.hybrid import group_layers

    if cfg.is_mla:
        return None
    n = cfg.num_hidden_layers
    lay = group_layers([cfg.attention_window(i) for i in range(n)],
                       [cfg.attention_chunk(i) for i in range(n)])
    if lay is None:
        return None
    full = sum(not lay.releases(g) for g in range(lay.num_groups))
    # what a windowed (chunked) group holds at most: a window's (a chunk's) tokens
    window = max((lay.windows[g] or lay.chunk(g) or 0) for g in range(lay.num_groups))
    per_token = kv_per_layer * lay.num_slots * full
    window_bytes = window * kv_per_layer * lay.num_slots * (lay.num_groups - full)
    return {"slots": lay.num_slots, "full_groups": full, "windowed_groups": lay.num_groups - full,
            "window": window, "kv_bytes_per_token_past_window": per_token,
            "kv_bytes_window": window_bytes,
            "tokens_in_memory": max(0, memory_bytes - window_bytes) // per_token}

def parse_memory(s: str) -> int:
    """Bytes in a memory size: "80GiB", "80G" (both 80 * 2**30), "80GB" (80 * 10**9),
    "512MiB", "1.5TiB", "4096" (bytes). Units are case-insensitive."""
    m = _MEMORY_RE.match(str(s))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read memory size {s!r}: use a number with an optional unit, "
            "e.g. 80GiB, 80G (GiB), 80GB (10^9 bytes), 512MiB, 1TiB or plain bytes"
        )
    nbytes = int(float(m.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory size must be positive, got {s!r}")
    return nbytes


# ------------------------------------------------------------------ parameters
# families whose MLP is not gated (c_fc -> act -> c_proj, under their names) and whose
# LayerNorms have a bias (but Arcee's: RMSNorms)
_PLAIN_MLP = ("starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "phi", "gptj", "falcon", "opt",
              "bloom", "mpt", "arcee", "apertus")
# norms a layer: input and post-attention; Gemma 2/3's pre- and post-feedforward ones too
# (GLM-4's post_self_attn / post_mlp ones); Cohere's (and Cohere2's), Phi's and GPT-J's one
# norm feeds attention and the MLP
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "glm4": 4, "cohere": 1, "cohere2": 1,
                    "phi": 1, "gptj": 1}


def _norms_per_layer(cfg: ModelConfig) -> int:
    if cfg.model_type == "falcon":  # a parallel layer's one or two (ln_attn, ln_mlp)
        return cfg.parallel_norms if cfg.use_parallel_residual else 2
    return _NORMS_PER_LAYER.get(cfg.model_type, 2)


def _attention_params(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    if cfg.is_mla:
        assert cfg.kv_lora_rank is not None
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:  # q_a_proj, q_a_layernorm, q_b_proj
            q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
        else:  # q_proj
            q = h * heads * qk
        kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank  # + kv_a_layernorm
        kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        o = heads * cfg.v_head_dim * h
        return q + kv_a + kv_b + o
    d = cfg.head_dim
    q_dim, kv_dim = heads * d, cfg.num_key_value_heads * d
    n = h * q_dim + 2 * h * kv_dim + q_dim * h
    if cfg.attention_bias:
        n += q_dim + 2 * kv_dim
    if cfg.o_proj_bias:  # Llama's with q/k/v's, Seed-OSS's on its own
        n += h
    # Cohere's q/k LayerNorms have weights per head; Qwen3's (HunYuan's, after rotary) one
    # of head_dim
    if cfg.qk_norm or cfg.model_type == "hunyuan_v1_dense":
        # (Phi's LayerNorms a bias too)
        n += {"cohere": q_dim + kv_dim, "phi": 4 * d}.get(cfg.model_type, 2 * d)
    if cfg.model_type in ("olmo2", "olmo3", "olmoe"):  # q_norm / k_norm over the whole projections
        n += q_dim + kv_dim
    if cfg.attention_sinks:  # GPT-OSS: one sink logit per query head
        n += heads
    return n


def _shared_experts(cfg: ModelConfig) -> tuple[str, int]:
    """(module name, intermediate size) of an MoE layer's always-on MLP: DeepSeek's
    ``shared_experts`` (n_shared_experts of moe_intermediate_size, merged), Qwen2-MoE's
    ``shared_expert``, GraniteMoeShared's ``shared_mlp`` (beside the layer's
    block_sparse_moe in its checkpoints); size 0 where there is none."""
    if cfg.shared_expert_intermediate_size:
        name = "shared_mlp" if cfg.model_type == "granitemoeshared" else "shared_expert"
        return name, cfg.shared_expert_intermediate_size
    return "shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts


def _mlp_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(total, active per token) parameters of one layer's MLP."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        inter = cfg.intermediate_size
        if cfg.model_type in _PLAIN_MLP:  # c_fc, c_proj (not gated)
            n = 2 * h * inter + (inter + h if cfg.mlp_bias else 0)
            n += 2 if cfg.hidden_act == "xielu" else 0  # Apertus: xIELU's alpha_p, alpha_n
        else:
            n = 3 * h * inter
        return n, n
    assert cfg.n_routed_experts is not None
    expert = 3 * h * cfg.moe_intermediate_size
    router = cfg.n_routed_experts * h
    if cfg.topk_method == "noaux_tc":  # e_score_correction_bias
        router += cfg.n_routed_experts
    if cfg.model_type == "gpt_oss":  # the router's bias; each expert's gate_up and down biases
        router += cfg.n_routed_experts
        expert += 2 * cfg.moe_intermediate_size + h
    shared = 3 * h * _shared_experts(cfg)[1]
    if cfg.model_type == "qwen2_moe":
        shared += h  # Qwen2-MoE's shared_expert_gate
    total = router + shared + cfg.n_routed_experts * expert
    active = router + shared + cfg.num_experts_per_tok * expert
    return total, active


def fp8_linears(cfg: ModelConfig) -> list[tuple[tuple[str, ...], int, int]]:
    """(HF modules whose rows it holds, N, K) of every linear our fp8 layers can hold in
    e4m3 (layers/quant.py): attention projections (not MLA's kv_b_proj), dense MLPs and
    shared experts; not the embeddings, LM head, routed experts or router. Merged linears
    (Llama's qkv_proj, gate_up_proj; DeepSeek's gate_up_proj) name their pieces."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    out: list[tuple[tuple[str, ...], int, int]] = []
    for layer in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        if cfg.model_type in ("gpt2", "gpt_bigcode"):  # GPT-2's names; c_attn holds q, k and v
            a, m = f"transformer.h.{layer}.attn", f"transformer.h.{layer}.mlp"
            q_dim, kv_dim = heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            out += [((f"{a}.c_attn",), q_dim + 2 * kv_dim, h), ((f"{a}.c_proj",), h, q_dim),
                    ((f"{m}.c_fc",), cfg.intermediate_size, h),
                    ((f"{m}.c_proj",), h, cfg.intermediate_size)]
            continue
        if cfg.is_mla:
            assert cfg.kv_lora_rank is not None
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            if cfg.q_lora_rank:
                out += [((f"{a}.q_a_proj",), cfg.q_lora_rank, h),
                        ((f"{a}.q_b_proj",), heads * qk, cfg.q_lora_rank)]
            else:
                out.append(((f"{a}.q_proj",), heads * qk, h))
            out += [((f"{a}.kv_a_proj_with_mqa",), cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                    ((f"{a}.o_proj",), h, heads * cfg.v_head_dim)]
        else:
            q_dim, kv_dim = heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            out += [((f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"), q_dim + 2 * kv_dim, h),
                    ((f"{a}.o_proj",), h, q_dim)]
        inter = cfg.intermediate_size
        if cfg.is_moe_layer(layer):
            shared, inter = _shared_experts(cfg)
            m += f".{shared}"
        if cfg.model_type == "granitemoeshared" and inter:
            # beside block_sparse_moe in the layer, gate and up in one checkpoint tensor
            m = f"model.layers.{layer}.shared_mlp"
            out += [((f"{m}.input_linear",), 2 * inter, h), ((f"{m}.output_linear",), h, inter)]
        elif cfg.model_type in _PLAIN_MLP:  # under our names (StarCoder2's; renamed below)
            out += [((f"{m}.c_fc",), inter, h), ((f"{m}.c_proj",), h, inter)]
        elif inter:
            out += [((f"{m}.gate_proj", f"{m}.up_proj"), 2 * inter, h), ((f"{m}.down_proj",), h, inter)]
    return _checkpoint_names(cfg, out)


# families whose checkpoints hold q/k/v (and gate/up) as one tensor: Phi-3's qkv_proj /
# gate_up_proj, GPT-NeoX's and Falcon's query_key_value (its rows regrouped: _piece_rows)
_MERGED_ON_DISK = {"Phi3ForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM",
                   "BloomForCausalLM", "MptForCausalLM"}
_MERGED_NAMES = {"q_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
# ... and those that hold gate/up merged alone (GLM's and GLM-4's mlp.gate_up_proj)
_GATE_UP_ON_DISK = {"GlmForCausalLM", "Glm4ForCausalLM"}
# families whose checkpoints name our modules otherwise (their models' ``hf_names``)
_RENAMED = {"GPTNeoXForCausalLM", "PhiForCausalLM", "GPTJForCausalLM", "FalconForCausalLM",
            "OPTForCausalLM", "BloomForCausalLM", "MptForCausalLM", "ArceeForCausalLM",
            "ApertusForCausalLM", "Llama4ForCausalLM"}


def _checkpoint_names(cfg: ModelConfig, out: list[tuple[tuple[str, ...], int, int]]
                      ) -> list[tuple[tuple[str, ...], int, int]]:
    """``fp8_linears``' modules under the checkpoint's own names: merged ones named once
    where the file holds them merged, and a family's ``hf_names`` applied (_RENAMED)."""
    names = None
    if cfg.architecture == "FalconForCausalLM":  # its names follow its layer form
        from flashpage.models.falcon import falcon_names  # torch: only for these families

        names = falcon_names(cfg)
    elif cfg.architecture in _RENAMED:
        from flashpage.models.registry import model_class

        names = getattr(model_class(cfg), "hf_names", None)
    renamed = []
    for pieces, n, k in out:
        if len(pieces) > 1 and (cfg.architecture in _MERGED_ON_DISK or (
                cfg.architecture in _GATE_UP_ON_DISK and pieces[0].endswith(".gate_proj"))):
            parent, leaf = pieces[0].rsplit(".", 1)
            pieces = (f"{parent}.{_MERGED_NAMES[leaf]}",)
        if names is not None:
            pieces = tuple(names.to_hf(p) for p in pieces)
        renamed.append((pieces, n, k))
    return renamed


def _piece_rows(cfg: ModelConfig, pieces: tuple[str, ...], n: int) -> list[tuple[str, int]]:
    """Each HF piece of a linear ``fp8_linears`` names, with its rows (q, k, v; gate, up).
    GPT-NeoX's and Falcon's query_key_value: a piece per head's q, k or v (its rows are
    regrouped head by head at load, so its block scales stack only where a head is whole
    blocks), one piece where Falcon's one KV group is not regrouped."""
    if pieces[0].endswith(".query_key_value") and not (
            cfg.architecture == "FalconForCausalLM" and cfg.num_key_value_heads == 1):
        return [(pieces[0], cfg.head_dim)] * (n // cfg.head_dim)
    if len(pieces) == 3:
        kv = cfg.num_key_value_heads * cfg.head_dim
        return list(zip(pieces, (n - 2 * kv, kv, kv), strict=True))
    return [(p, n // len(pieces)) for p in pieces]


def fp8_weight_shapes(cfg: ModelConfig, quantization: str | None = "fp8"
                      ) -> list[tuple[int, int, int, bool]]:
    """(N, K, fp32 scales it holds, whether they are per tile) of every linear the engine
    holds in e4m3 for ``quantization`` ("fp8": every one ``fp8_linears`` names) and the
    checkpoint's own ``quantization_config``: an fp8 checkpoint's per-tensor / per-channel
    linears are kept with a scale per row, block-scaled ones with a scale per tile, except
    merged ones whose block scales do not stack (``CheckpointQuantization.
    block_unsupported``: dequantized, so kept only under "fp8", a scale per row); those
    with a piece in its ignore list stay 16-bit either way (models/fp8_checkpoint.py)."""
    qc = cfg.quantization_config
    if qc is not None and qc.is_int4:
        return []  # int4 linears stay int4 under "fp8" too: int4_weight_shapes
    out = []
    for pieces, n, k in fp8_linears(cfg):
        if qc is not None and any(qc.ignores(p) for p in pieces):
            continue
        if (qc is not None and qc.weight_strategy == "block"
                and qc.block_unsupported(_piece_rows(cfg, pieces, n)) is None):
            assert qc.block_size is not None
            bn, bk = qc.block_size
            out.append((n, k, -(-n // bn) * -(-k // bk), True))
        elif quantization == "fp8" or (qc is not None and qc.weight_strategy != "block"):
            out.append((n, k, n, False))
    return out


# Families whose checkpoints name routed experts ``...experts.{e}.{gate,up,down}_proj.weight``
# (layers/moe.EXPERT_NAME): a block-fp8 checkpoint's are kept in e4m3 there
FP8_EXPERT_FAMILIES = ("deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe")


def fp8_expert_values(cfg: ModelConfig) -> int:
    """Values of the routed experts a block-fp8 checkpoint keeps in e4m3 where the fused fp8
    MoE kernel runs them (models/fp8_checkpoint.hold_fp8_experts): 128 x 128 blocks, hidden
    and expert intermediate sizes whole blocks, a family whose expert names the loader reads,
    the experts not in the ignore list; 0 otherwise (dequantized at load)."""
    qc, inter = cfg.quantization_config, cfg.moe_intermediate_size or 0
    if (qc is None or qc.is_int4 or qc.weight_strategy != "block" or qc.block_size != (128, 128)
            or not cfg.n_routed_experts or cfg.model_type not in FP8_EXPERT_FAMILIES
            or cfg.hidden_size % 128 or inter % 128):
        return 0
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
              and not qc.ignores(f"model.layers.{i}.mlp.experts.0.gate_proj")]
    return 3 * cfg.n_routed_experts * inter * cfg.hidden_size * len(layers)


def int4_expert_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(values, bytes held) of the routed experts an AWQ / GPTQ checkpoint keeps packed where
    the fused int4 MoE kernel runs them (models/int4_checkpoint.hold_int4_experts): Mixtral /
    Qwen2-MoE / Qwen3-MoE, groups the kernel takes, the experts not in the ignore list; half
    a byte a value plus an fp16 scale and a uint8 zero a group. (0, 0) otherwise
    (dequantized at load)."""
    from flashpage.config import INT4_MOE_FAMILY
    from flashpage.kernels.fused_moe_int4 import kernel_supports

    qc, inter, h = cfg.quantization_config, cfg.moe_intermediate_size or 0, cfg.hidden_size
    if (qc is None or not qc.is_int4 or not cfg.n_routed_experts
            or cfg.architecture not in INT4_MOE_FAMILY or not inter):
        return 0, 0
    g1, g2 = qc.group_size or h, qc.group_size or inter
    if kernel_supports(h, inter, g1, g2) is not None:
        return 0, 0
    first = ("block_sparse_moe.experts.0.w1" if cfg.architecture == "MixtralForCausalLM"
             else "mlp.experts.0.gate_proj")
    layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
                 and not qc.ignores(f"model.layers.{i}.{first}"))
    e = cfg.n_routed_experts
    values = 3 * e * inter * h * layers
    groups = e * (2 * inter * (h // g1) + h * (inter // g2)) * layers
    return values, values // 2 + 3 * groups


def online_expert_bytes(cfg: ModelConfig, quantization: str | None) -> tuple[int, int]:
    """(values, bytes held) of the routed experts ``quantization`` ("fp8", "int4" / "rtn")
    quantizes at load where their fused kernel keeps them (layers/quant.quantize_model,
    FusedExperts.quantize_fp8 / quantize_int4): a 16-bit checkpoint's (no
    quantization_config), not MXFP4 nor GPT-OSS's (biases, clamped SwiGLU); "fp8" with
    hidden and expert intermediate sizes whole 128-blocks (a byte a value, an fp32 scale a
    block), int4 in the groups the linears take (int4_group_for) where the kernel takes
    them (half a byte a value, an fp16 scale and a uint8 zero a group). (0, 0) otherwise."""
    from flashpage.kernels.fused_moe_int4 import kernel_supports

    h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size or 0, cfg.n_routed_experts or 0
    if (quantization is None or cfg.quantization_config is not None or not e or not inter
            or cfg.mxfp4_experts or cfg.model_type == "gpt_oss"):
        return 0, 0
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    values = 3 * e * inter * h * layers
    if quantization == "fp8":
        if h % 128 or inter % 128:
            return 0, 0
        return values, values + 4 * (values // 128 ** 2)
    group = online_int4_group_size(quantization)
    g1, g2 = int4_group_for(h, group) or h, int4_group_for(inter, group) or inter
    if kernel_supports(h, inter, g1, g2) is not None:
        return 0, 0
    groups = e * (2 * inter * (h // g1) + h * (inter // g2)) * layers
    return values, values // 2 + 3 * groups


def int4_weight_shapes(cfg: ModelConfig, quantization: str | None = None) -> list[tuple[int, int, int]]:
    """[N, K, G] of every linear the engine holds in int4 for an AWQ / GPTQ checkpoint:
    those ``fp8_linears`` names with no piece in its ignore list (models/int4_checkpoint.py);
    for a 16-bit checkpoint under ``quantization`` "int4" / "rtn", every one of them whose K
    is a multiple of 8 (layers/quant.py); for a block-scaled fp8 one, those it dequantized
    at load (``fp8_weight_shapes`` names the ones it keeps in e4m3) and does not ignore."""
    qc = cfg.quantization_config
    if quantization in ONLINE_INT4_METHODS and (qc is None or qc.weight_strategy == "block"):
        group = online_int4_group_size(quantization)
        return [(n, k, int4_group_for(k, group) or k) for pieces, n, k in fp8_linears(cfg)
                if k % 8 == 0 and (qc is None or (
                    not any(qc.ignores(p) for p in pieces)
                    and qc.block_unsupported(_piece_rows(cfg, pieces, n)) is not None))]
    if qc is None or not qc.is_int4:
        return []
    return [(n, k, qc.group_size or k) for pieces, n, k in fp8_linears(cfg)
            if not any(qc.ignores(p) for p in pieces)]


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the model, from its config alone."""
    h = cfg.hidden_size
    width = cfg.word_embed_proj_dim or h  # the token embeddings' (OPT-350m's 512 of 1024)
    embed = cfg.vocab_size * width
    head = h * cfg.num_labels if cfg.is_classifier else (0 if cfg.tie_word_embeddings else embed)
    head += cfg.vocab_size if cfg.lm_head_bias else 0  # Phi's
    # LayerNorms with a bias too (Starcoder2's, GPT-2's, ...); OLMo (1)'s and OPT's without
    # elementwise_affine hold neither weight nor bias
    affine = cfg.model_type != "olmo" and cfg.norm_elementwise_affine
    # (MPT's LayerNorms: a weight alone unless no_bias is false)
    # (Arcee's and Apertus': RMSNorms, no bias)
    biased = (cfg.model_type in _PLAIN_MLP and cfg.model_type not in ("arcee", "apertus")
              and (cfg.model_type != "mpt" or cfg.attention_bias))
    norm = 0 if not affine else 2 * h if biased else h
    # GPT-2's wpe, OPT's embed_positions (2 rows more)
    wpe = (cfg.max_position_embeddings + cfg.position_offset) * h if cfg.learned_positions else 0
    proj = 2 * width * h if width != h else 0  # OPT's project_in / project_out
    # + final norm (not OPT's post-LN one), lm_head (a classifier's: its score head)
    fixed = embed + wpe + proj + (norm if cfg.final_norm else 0) + head
    if cfg.model_type == "bloom":  # word_embeddings_layernorm
        fixed += norm
    total = active = fixed
    attn = _attention_params(cfg) + _norms_per_layer(cfg) * norm
    for layer in range(cfg.num_hidden_layers):
        mlp_total, mlp_active = _mlp_params(cfg, layer)
        total += attn + mlp_total
        active += attn + mlp_active
    return total, active


# --------------------------------------------------------------------- report
def vision_figures(cfg: ModelConfig, image_size: tuple[int, int], wbytes: int,
                   kv_bytes_per_token: int) -> dict[str, Any] | None:
    """An image model's tower and projector (models/multimodal.image_encoder_shell, built on
    the meta device): its parameters and bytes (in ``wbytes``, at least 16-bit: the engine
    quantizes the text model's linears only), and the prompt rows of one blank image of
    ``image_size`` (width, height) as the engine's preprocessing makes them, with their KV
    bytes. None for a model that takes no images."""
    import torch

    from flashpage.models.multimodal import image_encoder_shell

    with torch.device("meta"):
        enc: Any = image_encoder_shell(cfg)
    if enc is None:
        return None
    params = sum(p.numel() for p in enc.parameters())
    try:
        from PIL import Image
    except ImportError:  # the image figures need the engine's preprocessing, which reads PIL images
        rows = None
    else:
        img = Image.new("RGB", image_size)
        # (Gemma 3's image_rows: its pan-and-scan crops' rows too, where preprocessor_config.json
        # turns them on)
        rows = enc.image_rows(img) if hasattr(enc, "image_rows") else enc.num_rows(enc.pixel_values(img))
    return {"params": params, "bytes": params * max(wbytes, 2), "image_size": list(image_size),
            "image_tokens": rows, "kv_bytes_per_image": None if rows is None else rows * kv_bytes_per_token}


def audio_figures(cfg: ModelConfig, wbytes: int, kv_bytes_per_token: int) -> dict[str, Any] | None:
    """An audio model's encoder and projector (models/multimodal.audio_encoder_shell, on the
    meta device): its parameters and bytes (at least 16-bit), and the prompt rows of the
    longest audio it takes (one chunk: 30 s for Qwen2-Audio) with their KV bytes. None for
    a model that takes no audio."""
    import torch

    from flashpage.models.multimodal import audio_encoder_shell
    from flashpage.models.qwen2_audio_config import audio_token_count

    with torch.device("meta"):
        enc: Any = audio_encoder_shell(cfg)
    if enc is None:
        return None
    params = sum(p.numel() for p in enc.parameters())
    f = enc.config.features
    rows = audio_token_count(f.n_samples, f)
    return {"params": params, "bytes": params * max(wbytes, 2), "max_seconds": f.chunk_length,
            "sampling_rate": f.sampling_rate, "max_audio_tokens": rows,
            "tokens_per_second": rows / f.chunk_length, "kv_bytes_per_max_audio": rows * kv_bytes_per_token}


def parse_image_size(s: str) -> tuple[int, int]:
    """"1024x768" -> (1024, 768): width x height in pixels, each positive."""
    parts = s.lower().replace("*", "x").split("x")
    try:
        w, h = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"image size {s!r}: give WIDTHxHEIGHT in pixels, e.g. 1024x768") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"image size {s!r}: width and height must be positive")
    return w, h


def inspect_config(cfg: ModelConfig, memory_bytes: int, dtype: str = DEFAULT_DTYPE,
                   kv_cache_dtype: str = "auto", quantization: str | None = None,
                   image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    """Every figure ``flashpage inspect`` reports, as a JSON-serializable dict. The weights
    take ``dtype`` (``quantization`` "fp8", or an fp8 checkpoint's quantization_config:
    those the engine holds in e4m3 1 byte each, plus an fp32 scale per output row:
    ``fp8_weight_shapes``); the KV cache ``kv_cache_dtype`` ("auto": ``dtype``, "fp8":
    1 byte). An image model's tower (``vision_figures``, one image of ``image_size``) is
    counted apart and in the tokens left after the weights, as the engine loads it."""
    check_quantization(quantization)
    wbytes = dtype_bytes(dtype)
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    nbytes = dtype_bytes(kv_dtype)
    layers = cfg.num_hidden_layers
    kv_values = cfg.kv_values_per_token_per_layer
    mha_values = cfg.mha_values_per_token_per_layer
    kv_per_layer = kv_values * nbytes
    kv_total = kv_per_layer * layers
    total_params, active_params = param_counts(cfg)
    weights_bytes = total_params * wbytes
    shapes = fp8_weight_shapes(cfg, quantization)
    if shapes:
        fp8_values = sum(n * k for n, k, _, _ in shapes)
        weights_bytes += fp8_values * (1 - wbytes) + 4 * sum(s for _, _, s, _ in shapes)
    int4 = int4_weight_shapes(cfg, quantization)
    for n, k, g in int4:  # half a byte a value, an fp16 scale and a uint8 zero a group
        weights_bytes += n * k // 2 - n * k * wbytes + 3 * n * (k // g)
    # MXFP4 experts (GPT-OSS's checkpoints): held so by default (the engine on CUDA with the
    # triton backend: FLASHPAGE_MXFP4, models/gpt_oss.py), 4.25 bits a weight
    mx_values = (3 * cfg.n_routed_experts * (cfg.moe_intermediate_size or 0) * cfg.hidden_size
                 * sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
                 if cfg.mxfp4_experts and cfg.n_routed_experts else 0)
    mx_kept = bool(mx_values) and envs.mxfp4() != "dequant"
    if mx_kept:
        weights_bytes += mx_values * 17 // 32 - mx_values * wbytes
    # block-fp8 experts: kept in e4m3 by default as well (FLASHPAGE_FP8_MOE, where the fused
    # fp8 MoE kernel runs), a byte a value and an fp32 scale per 128 x 128 block
    f8_values = fp8_expert_values(cfg)
    f8_bytes = f8_values + 4 * (f8_values // 128 ** 2)
    f8_kept = bool(f8_values) and envs.fp8_moe() != "dequant"
    if f8_kept:
        weights_bytes += f8_bytes - f8_values * wbytes
    # int4 experts (an AWQ / GPTQ checkpoint's): kept packed by default (FLASHPAGE_INT4_MOE,
    # where the fused int4 MoE kernel runs)
    i4_values, i4_bytes = int4_expert_bytes(cfg)
    i4_kept = bool(i4_values) and envs.int4_moe() != "dequant"
    if i4_kept:
        weights_bytes += i4_bytes - i4_values * wbytes
    # a 16-bit checkpoint's experts under quantization "fp8" / "int4" / "rtn": quantized at
    # load where the fused kernel keeps them (FLASHPAGE_FP8_MOE / FLASHPAGE_INT4_MOE), too
    q_values, q_bytes = online_expert_bytes(cfg, quantization)
    q_kept = bool(q_values) and (envs.fp8_moe() if quantization == "fp8"
                                 else envs.int4_moe()) != "dequant"
    if q_kept:
        weights_bytes += q_bytes - q_values * wbytes
    qc = cfg.quantization_config
    vision = vision_figures(cfg, image_size, wbytes, kv_total)
    audio = audio_figures(cfg, wbytes, kv_total)
    # the encoders' bytes, beside the text model's weights
    vision_bytes = (0 if vision is None else vision["bytes"]) + (0 if audio is None else audio["bytes"])
    info: dict[str, Any] = {
        "architecture": cfg.architecture,
        "model_type": cfg.model_type,
        # a multimodal checkpoint's wrapper (config.MULTIMODAL_TEXT_ARCHITECTURES): every
        # figure here is its text model's, which is all that runs (no image input)
        "multimodal_architecture": cfg.multimodal_architecture or None,
        # LLaVA / Qwen2-VL / Pixtral: its images run too; their tower and one image's rows
        # (vision_figures), the tower's bytes not in weights_bytes
        "image_input": cfg.vision is not None,
        "vision": vision,
        # Qwen2-Audio: its audio runs too; the encoder and one longest audio's rows
        # (audio_figures), the encoder's bytes not in weights_bytes
        "audio_input": cfg.audio is not None,
        "audio": audio,
        "attention_kind": cfg.attention_kind,
        "num_hidden_layers": layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        # MLA caches one latent shared by all heads, whatever num_key_value_heads says
        "cached_kv_heads": 1 if cfg.is_mla else cfg.num_key_value_heads,
        "group_size": cfg.group_size,
        "head_dim": None if cfg.is_mla else cfg.head_dim,
        "mla": None,
        "sliding_window": cfg.sliding_window,
        # Gemma 2/3 and Cohere2 window some layers only (layer_types)
        "sliding_window_layers": sum(cfg.attention_window(i) is not None
                                     for i in range(cfg.num_hidden_layers)),
        # Llama 4's chunked local attention: its chunk, on how many layers
        "attention_chunk_size": cfg.attention_chunk_size,
        "chunked_layers": sum(cfg.attention_chunk(i) is not None
                              for i in range(cfg.num_hidden_layers)),
        # rotary over the first rotary_dim dims of a head (Phi-3's partial_rotary_factor) and
        # its scaling (longrope: the factor lists applied past original_max_position_embeddings)
        "rotary_dim": None if cfg.is_mla or cfg.learned_positions else cfg.rotary_dim,
        # GPT-2's wpe rows (OPT's embed_positions, 2 more): positions past
        # max_position_embeddings have none
        "learned_positions": cfg.learned_positions,
        "position_rows": (cfg.max_position_embeddings + cfg.position_offset
                          if cfg.learned_positions else None),
        "rotary_interleaved": cfg.rope_interleaved,  # Cohere's pairs (x[2i], x[2i + 1])
        # layers without any positional embedding (NoPE: Cohere2's full-attention ones,
        # SmolLM3's no_rope_layers)
        "nope_layers": 0 if cfg.learned_positions else sum(
            not cfg.uses_rope(i) for i in range(cfg.num_hidden_layers)),
        "rope_scaling": None if cfg.rope_scaling is None else {
            "type": cfg.rope_scaling.rope_type,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_position_embeddings},
        "max_position_embeddings": cfg.max_position_embeddings,
        "dtype": dtype,
        "dtype_bytes": wbytes,
        "kv_cache_dtype": kv_dtype,
        "kv_values_per_token_per_layer": kv_values,
        "kv_bytes_per_token_per_layer": kv_per_layer,
        "kv_bytes_per_token": kv_total,
        # every layer windowed: the engine gives blocks behind the window back, so a request
        # holds about a window's tokens (and one step's) whatever its length
        "kv_bytes_per_request_max": (cfg.sliding_window * kv_total if cfg.sliding_window
                                     and not cfg.is_mla and all(
                                         cfg.attention_window(i) == cfg.sliding_window
                                         for i in range(cfg.num_hidden_layers)) else None),
        # layers mixing one window with full attention: KV cache groups (kv_cache/hybrid.py)
        "kv_groups": _kv_groups(cfg, kv_per_layer, memory_bytes),
        "mha_kv_values_per_token_per_layer": mha_values,
        "mha_kv_bytes_per_token_per_layer": mha_values * nbytes,
        "mha_kv_bytes_per_token": mha_values * nbytes * layers,
        "kv_reduction_vs_mha": mha_values / kv_values,
        "memory_bytes": memory_bytes,
        "tokens_in_memory": memory_bytes // kv_total,
        "param_count": total_params,
        "active_param_count": active_params,
        "quantization": quantization,
        # GPT-OSS: a sink logit per query head in every layer's softmax; MXFP4 experts in
        # the checkpoint, kept so for the fused MoE kernel (mxfp4_kept: weights_bytes counts
        # them at 4.25 bits a weight) unless FLASHPAGE_MXFP4=dequant (then in ``dtype``)
        "attention_sinks": cfg.attention_sinks,
        "mxfp4_experts": cfg.mxfp4_experts,
        "mxfp4_kept": mx_kept,
        "mxfp4_expert_bytes": mx_values * 17 // 32,
        "mxfp4_expert_bytes_dequantized": mx_values * wbytes,
        # a block-fp8 checkpoint's routed experts kept in e4m3 (fp8_expert_values; the
        # engine's default where the fused fp8 MoE kernel runs, FLASHPAGE_FP8_MOE)
        "fp8_experts_kept": f8_kept,
        "fp8_expert_bytes": f8_bytes,
        "fp8_expert_bytes_dequantized": f8_values * wbytes,
        # an AWQ / GPTQ checkpoint's routed experts kept packed (int4_expert_bytes; the
        # engine's default where the fused int4 MoE kernel runs, FLASHPAGE_INT4_MOE)
        "int4_experts_kept": i4_kept,
        "int4_expert_bytes": i4_bytes,
        "int4_expert_bytes_dequantized": i4_values * wbytes,
        # a 16-bit checkpoint's routed experts quantized at load by ``quantization``
        # (online_expert_bytes; where the fused fp8 / int4 MoE kernel runs them)
        "quantized_experts_kept": q_kept,
        "quantized_expert_bytes": q_bytes,
        "quantized_expert_bytes_16bit": q_values * wbytes,
        # an fp8 checkpoint's own quantization_config (config.CheckpointQuantization)
        "quantization_config": None if qc is None else {
            "method": qc.method, "weight_strategy": qc.weight_strategy,
            "block_size": list(qc.block_size) if qc.block_size else None,
            "activation_scheme": qc.activation_scheme, "ignored": list(qc.ignored),
            "bits": qc.bits, "group_size": qc.group_size},
        "fp8_linears": len(shapes),
        # a block-scaled checkpoint's linears kept with their tiles' scales
        "fp8_block_linears": sum(block for *_, block in shapes),
        "int4_linears": len(int4),
        "weights_bytes": weights_bytes,
        # an image model's tower included (the engine loads it beside the text model)
        "tokens_in_memory_after_weights": max(0, memory_bytes - weights_bytes - vision_bytes) // kv_total,
        # MoE: routed experts, how many a token takes, in how many layers; None: dense
        "moe": None if not cfg.n_routed_experts else {
            "experts": cfg.n_routed_experts, "experts_per_token": cfg.num_experts_per_tok,
            "moe_layers": sum(cfg.is_moe_layer(i) for i in range(layers)),
            "expert_intermediate_size": cfg.moe_intermediate_size,
            "shared_intermediate_size": _shared_experts(cfg)[1]},
        # a sequence classifier's labels (config.json's id2label), None for a generator
        "labels": list(cfg.labels) if cfg.is_classifier else None,
    }
    if cfg.is_mla:
        assert cfg.kv_lora_rank is not None
        info["mla"] = {
            "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "equivalent_gqa_groups": kv_values / (2 * cfg.qk_nope_head_dim),
        }
    return info


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_report(info: dict[str, Any]) -> str:
    """``inspect_config``'s dict as a two-column text table."""
    dt = info["dtype"]
    kdt = info.get("kv_cache_dtype", dt)
    layers = info["num_hidden_layers"]
    heads, kv_heads = info["num_attention_heads"], info["num_key_value_heads"]
    rows: list[tuple[str, str]] = []
    if info.get("source"):
        rows.append(("model", str(info["source"])))
    rows.append(("architecture", f"{info['architecture']} ({info['model_type']})"))
    if info.get("multimodal_architecture") and info.get("audio_input"):
        rows.append(("multimodal", f"{info['multimodal_architecture']}: its text model and "
                                   "audio input (the audio encoder and projector: below)"))
    elif info.get("multimodal_architecture") and info.get("image_input"):
        rows.append(("multimodal", f"{info['multimodal_architecture']}: its text model and "
                                   "image input (the vision tower and projector: below)"))
    elif info.get("multimodal_architecture"):
        rows.append(("multimodal", f"{info['multimodal_architecture']}: its text model only "
                                   "(image inputs are not supported; the vision tower is not "
                                   "loaded nor counted here)"))
    rows += [
        ("attention", info["attention_kind"]),
        ("layers", str(layers)),
        ("query heads", str(heads)),
    ]
    mla = info["mla"]
    if mla:
        rows += [
            ("KV heads", f"1 latent shared by all {heads} heads "
                         f"(config's num_key_value_heads={kv_heads} is not what is cached)"),
            ("group size", f"{info['group_size']} (every query head reads the one latent)"),
            ("kv_lora_rank", str(mla["kv_lora_rank"])),
            ("q_lora_rank", str(mla["q_lora_rank"])),
            ("qk head dims", f"nope {mla['qk_nope_head_dim']} + rope {mla['qk_rope_head_dim']}"),
            ("v_head_dim", str(mla["v_head_dim"])),
        ]
    else:
        rows += [
            ("KV heads", str(kv_heads)),
            ("group size", str(info["group_size"])),
            ("head_dim", str(info["head_dim"])),
        ]
        rope = info.get("rope_scaling")
        longrope = bool(rope and rope["type"] == "longrope")
        if info.get("learned_positions"):
            n = info["max_position_embeddings"]
            table = "wpe" if info["model_type"] in ("gpt2", "gpt_bigcode") else "embed_positions"
            rows.append(("positions", f"learned ({table}, {info['position_rows']:,} rows: "
                                      f"max_model_len at most {n:,}), no rotary"))
        elif (info.get("rotary_dim") != info["head_dim"] or longrope
              or info.get("rotary_interleaved") or info.get("nope_layers")):
            text = (f"first {info['rotary_dim']} of {info['head_dim']} dims"
                    if info.get("rotary_dim") != info["head_dim"] else "all dims")
            if info.get("rotary_interleaved"):
                text += ", interleaved pairs (GPT-J's layout)"
            if info.get("nope_layers"):
                text += f"; none on {info['nope_layers']} of {layers} layers (NoPE)"
            if rope and longrope:
                original = rope["original_max_position_embeddings"]
                text += (f", longrope: long factors when max_model_len > {original}, "
                         "short ones otherwise")
            rows.append(("rotary", text))
    if info.get("labels"):
        labels = info["labels"]
        rows.append(("task", f"classify: {len(labels)} label(s) {', '.join(labels[:8])}"
                             f"{' ...' if len(labels) > 8 else ''} (no LM head: no generation)"))
    if info.get("moe"):
        moe = info["moe"]
        shared = (f", a shared MLP of {moe['shared_intermediate_size']}"
                  if moe["shared_intermediate_size"] else "")
        rows.append(("experts", f"{moe['experts_per_token']} of {moe['experts']} per token "
                                f"(intermediate {moe['expert_intermediate_size']}{shared}), "
                                f"in {moe['moe_layers']} of {layers} layers"))
    if info["sliding_window"]:
        windowed, layers = info["sliding_window_layers"], info["num_hidden_layers"]
        where = "" if windowed == layers else f" on {windowed} of {layers} layers"
        note = ("(blocks behind it go back to the pool)" if info["kv_bytes_per_request_max"]
                else "(its layers' blocks behind it go back to the pool: KV cache groups)"
                if info.get("kv_groups") else "(figures below cache every token)")
        rows.append(("sliding window", f"{info['sliding_window']}{where} {note}"))
    if info.get("attention_sinks"):
        rows.append(("attention sinks", "a learned logit per query head in every softmax "
                                        "(no cached values)"))
    if info.get("chunked_layers"):
        rows.append(("chunked attention", f"chunks of {info['attention_chunk_size']:,} on "
                     f"{info['chunked_layers']} of {layers} layers"
                     + (" (their blocks before a query's chunk go back to the pool: KV cache "
                        "groups)" if info.get("kv_groups") else
                        " (figures below cache every token)")))
    rows += [
        (f"KV per token per layer ({kdt})",
         f"{info['kv_values_per_token_per_layer']:,} values = "
         f"{info['kv_bytes_per_token_per_layer']:,} B"),
        (f"KV per token, {layers} layers",
         f"{info['kv_bytes_per_token']:,} B ({_size(info['kv_bytes_per_token'])})"),
        ("MHA form per token", f"{info['mha_kv_bytes_per_token']:,} B "
                               f"({info['mha_kv_bytes_per_token_per_layer']:,} B per layer)"),
        ("reduction vs MHA", f"{info['kv_reduction_vs_mha']:.2f}x"),
    ]
    if info["kv_bytes_per_request_max"]:
        cap = info["kv_bytes_per_request_max"]
        rows.append(("KV a request holds", f"at most ~{info['sliding_window']:,} tokens' "
                                           f"({_size(cap)}) + one step's, however long it runs"))
    if info.get("kv_groups"):
        kg = info["kv_groups"]
        rows.append(("KV cache groups", f"{kg['full_groups']} full + {kg['windowed_groups']} windowed, "
                                        f"{kg['slots']} layer{'s' if kg['slots'] > 1 else ''} a block"))
        rows.append(("KV a long request holds", f"{kg['kv_bytes_per_token_past_window']:,} B a token "
                                                f"(its full layers') + {_size(kg['kv_bytes_window'])} "
                                                "for the windowed layers' window"))
        rows.append(("one request's tokens in memory", f"{kg['tokens_in_memory']:,} (KV cache alone)"))
    if mla:
        rows.append(("equivalent GQA groups", f"{mla['equivalent_gqa_groups']:.2f} "
                                               "((kv_lora_rank + rope) / (2 * qk_nope_head_dim))"))
    if info.get("mxfp4_experts"):
        mx, deq = _size(info["mxfp4_expert_bytes"]), _size(info["mxfp4_expert_bytes_dequantized"])
        held = (f"kept so where the fused MoE kernel runs them (CUDA, the triton backend): {mx} "
                f"(dequantized to {dt} elsewhere or with FLASHPAGE_MXFP4=dequant: {deq})"
                if info.get("mxfp4_kept") else
                f"dequantized to {dt} at load (FLASHPAGE_MXFP4=dequant): {deq}, not {mx}")
        rows.append(("checkpoint weights", "experts in MXFP4 (4-bit e2m1, a power-of-two scale "
                                           f"per 32 values): {held}"))
    qc = info.get("quantization_config")
    if qc:
        desc = CheckpointQuantization(qc["method"], qc["weight_strategy"],
                                      tuple(qc["block_size"]) if qc["block_size"] else None,
                                      qc["activation_scheme"], tuple(qc["ignored"]),
                                      qc["bits"], qc["group_size"]).describe()
        kept = ("kept in int4 (4 bits a value), repacked for our kernels" if qc["bits"] == 4
                else "kept in e4m3, a scale per row" if qc["weight_strategy"] != "block" else
                f"kept in e4m3, a scale per block ({info['fp8_block_linears']} linears)"
                if info.get("fp8_block_linears") else f"dequantized to {dt} at load"
                + (", then quantized per row" if info.get("quantization") else ""))
        rows.append(("checkpoint weights", f"{desc}: {kept}"))
        if info.get("fp8_expert_bytes"):
            f8, deq = _size(info["fp8_expert_bytes"]), _size(info["fp8_expert_bytes_dequantized"])
            rows.append(("routed experts", (
                f"kept in e4m3 with their block scales where the fused fp8 MoE kernel runs "
                f"them (CUDA sm_89+, the triton backend): {f8} (dequantized to {dt} elsewhere "
                f"or with FLASHPAGE_FP8_MOE=dequant: {deq})") if info.get("fp8_experts_kept")
                else f"dequantized to {dt} at load (FLASHPAGE_FP8_MOE=dequant): {deq}, not {f8}"))
        if info.get("int4_expert_bytes"):
            i4, deq = _size(info["int4_expert_bytes"]), _size(info["int4_expert_bytes_dequantized"])
            rows.append(("routed experts", (
                f"kept in int4 with their group scales and zeros where the fused int4 MoE "
                f"kernel runs them (CUDA, the triton backend): {i4} (dequantized to {dt} "
                f"elsewhere or with FLASHPAGE_INT4_MOE=dequant: {deq})")
                if info.get("int4_experts_kept")
                else f"dequantized to {dt} at load (FLASHPAGE_INT4_MOE=dequant): {deq}, not {i4}"))
    if info.get("quantized_expert_bytes"):
        q, deq = _size(info["quantized_expert_bytes"]), _size(info["quantized_expert_bytes_16bit"])
        method = info["quantization"]
        kind, env, where = (("e4m3 with 128 x 128 block scales", "FLASHPAGE_FP8_MOE", "CUDA sm_89+")
                            if method == "fp8" else ("int4 groups", "FLASHPAGE_INT4_MOE", "CUDA"))
        rows.append(("routed experts", (
            f"quantized to {kind} at load where the fused MoE kernel runs them ({where}, the "
            f"triton backend): {q} (left {dt} elsewhere or with {env}=dequant: {deq})")
            if info.get("quantized_experts_kept") else f"left {dt} ({env}=dequant): {deq}, not {q}"))
    mem = _size(info["memory_bytes"])
    rows += [
        (f"tokens in {mem}", f"{info['tokens_in_memory']:,} (KV cache alone)"),
        ("parameters", f"{info['param_count'] / 1e9:.3f} B"
         + (f" ({info['active_param_count'] / 1e9:.3f} B active per token)"
            if info["active_param_count"] != info["param_count"] else "")),
        (f"weights ({dt}{', fp8 linears' if info.get('fp8_linears') else ''}"
         f"{', int4 linears' if info.get('int4_linears') else ''}"
         f"{', MXFP4 experts' if info.get('mxfp4_kept') else ''}"
         f"{', fp8 experts' if info.get('fp8_experts_kept') else ''}"
         f"{', int4 experts' if info.get('int4_experts_kept') else ''}"
         f"{', ' + str(info['quantization']) + ' experts' if info.get('quantized_experts_kept') else ''})",
         _size(info["weights_bytes"])),
    ]
    vis = info.get("vision")
    if vis:
        w, h = vis["image_size"]
        rows += [
            ("vision tower + projector", f"{vis['params'] / 1e9:.3f} B parameters, "
                                         f"{_size(vis['bytes'])} (16-bit)"),
            (f"one {w}x{h} image", "(install Pillow to count its tokens)" if vis["image_tokens"] is None
             else f"{vis['image_tokens']:,} prompt tokens, {_size(vis['kv_bytes_per_image'])} of KV cache"),
        ]
    aud = info.get("audio")
    if aud:
        rows += [
            ("audio encoder + projector", f"{aud['params'] / 1e9:.3f} B parameters, "
                                          f"{_size(aud['bytes'])} (16-bit)"),
            (f"one {aud['max_seconds']} s audio (the longest)",
             f"{aud['max_audio_tokens']:,} prompt tokens, {_size(aud['kv_bytes_per_max_audio'])} of KV cache"),
        ]
    rows.append((f"tokens in {mem} - weights" + (" - tower" if vis else "") + (" - encoder" if aud else ""),
                 f"{info['tokens_in_memory_after_weights']:,}"))
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if "backends" in info:
        b = info["backends"]
        lines = [f"\nattention backends on {b['device']} ({b['dtype']}):"]
        for e in b["backends"]:
            mark = "default" if e["default"] else ("can run" if e["can_run"] else "cannot run")
            why = f": {'; '.join(e['reasons'])}" if e["reasons"] else ""
            lines.append(f"  {e['name']:<13} {mark}{why}")
        text += "\n".join(lines)
    return text


# ------------------------------------------------------------------------ CLI
def load_model_config(model: str | None) -> tuple[ModelConfig, str]:
    """A ModelConfig from a config.json, a folder holding one (or one .gguf file), or a
    GGUF file; the default model when ``model`` is None. Returns it with its source."""
    from flashpage.models.gguf_config import default_model_path, gguf_to_hf_config, is_gguf_file

    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelConfig.from_hf(path), os.path.join(path, "config.json")
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            raise ConfigError(f"{path} holds no config.json and "
                              f"{'no' if not ggufs else len(ggufs)} .gguf files; name one")
        path = os.path.join(path, ggufs[0])
    if not os.path.isfile(path):
        raise ConfigError(f"no such file or folder: {path} "
                          "(give a config.json, a folder holding one, or a .gguf file)")
    if is_gguf_file(path):
        return ModelConfig.from_hf(gguf_to_hf_config(path)), path
    return ModelConfig.from_hf(path), path


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_or_config", nargs="?", default=None, metavar="MODEL_OR_CONFIG",
                        help="config.json, a folder holding one, or a .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--model", dest="model_option", default=None,
                        help="the same as MODEL_OR_CONFIG")
    parser.add_argument("--memory", default=DEFAULT_MEMORY,
                        help="memory to fill: 80GiB, 80G (= GiB), 80GB (10^9), 512MiB, bytes "
                             f"(default {DEFAULT_MEMORY})")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE,
                        help=f"weight dtype, and the KV cache's unless --kv-cache-dtype: fp32, fp16, "
                             f"bf16, fp8 (default {DEFAULT_DTYPE})")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the KV cache's dtype (auto: --dtype; fp8: what the engine's "
                             "--kv-cache-dtype fp8 caches, 1 byte per value)")
    parser.add_argument("--quantization", default=None, choices=["fp8", "int4", "rtn"],
                        help="the weights as the engine's --quantization keeps them (fp8: "
                             "attention and MLP linears 1 byte per weight; int4 / rtn: half a "
                             "byte, plus a scale and zero point per group)")
    parser.add_argument("--image-size", default="x".join(map(str, DEFAULT_IMAGE_SIZE)),
                        help="an image model's example image, WIDTHxHEIGHT pixels: how many "
                             "prompt tokens (and KV bytes) the engine's preprocessing makes of it "
                             "(default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--backends", action="store_true",
                        help="also say which attention backends can run this model on this "
                             "machine, and why the others cannot")
    parser.add_argument("--device", dest="backend_device", default="auto",
                        help="device for --backends: auto, cpu, cuda (default auto)")


def run_inspect(args: argparse.Namespace) -> int:
    """Print the report; 0 on success, 2 with a message on stderr for bad input."""
    positional, option = getattr(args, "model_or_config", None), getattr(args, "model_option", None)
    if positional and option and positional != option:
        print(f"flashpage inspect: error: two models given ({positional!r} and --model {option!r})",
              file=sys.stderr)
        return 2
    encoder_rc = _inspect_encoder(positional or option, args)
    if encoder_rc is not None:
        return encoder_rc
    try:
        memory = parse_memory(args.memory)
        cfg, source = load_model_config(positional or option)
        image_size = parse_image_size(getattr(args, "image_size", None) or "x".join(
            map(str, DEFAULT_IMAGE_SIZE)))
        info = inspect_config(cfg, memory, args.dtype, getattr(args, "kv_cache_dtype", "auto"),
                              getattr(args, "quantization", None), image_size)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"flashpage inspect: error: {e}", file=sys.stderr)
        return 2
    info = {"source": source, **info}
    if getattr(args, "backends", False):
        try:
            info["backends"] = _backends(cfg, args.backend_device, args.dtype)
        except ValueError as e:
            print(f"flashpage inspect: error: {e}", file=sys.stderr)
            return 2
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _inspect_encoder(model: str | None, args: argparse.Namespace) -> int | None:
    """An encoder-only model (flashpage/encoder/): print its report, which says it has no KV
    cache (there is no memory to fill), and return the exit code; anything else: None."""
    from flashpage.encoder.config import EncoderConfig, is_encoder_model

    if model is None or not is_encoder_model(os.path.expanduser(model)):
        return None
    try:
        cfg = EncoderConfig.from_hf(os.path.expanduser(model))
        nbytes = dtype_bytes(args.dtype)
        if nbytes == 1:
            raise ConfigError("encoder weights are not quantized: use --dtype fp32, fp16 or bf16")
    except ValueError as e:
        print(f"flashpage inspect: error: {e}", file=sys.stderr)
        return 2
    info = cfg.report(nbytes)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{cfg.architecture}: encoder-only ({info['task']}), {cfg.num_hidden_layers} layers, "
              f"hidden {cfg.hidden_size}, prompts up to {cfg.max_prompt_len} tokens\n"
              f"weights: {info['params'] / 1e6:.2f}M params, {_size(info['weight_bytes'])} in {args.dtype}\n"
              "KV cache: none (an encoder reads each prompt whole in one forward and keeps "
              "nothing; --memory does not apply)")
    return 0


def _backends(cfg: ModelConfig, device: str, dtype: str) -> dict[str, Any]:
    """The attention backends on this machine for ``cfg`` (what the engine would choose)."""
    import torch

    from flashpage.attention.registry import backend_report
    from flashpage.engine.llm_engine import resolve_device, resolve_dtype

    dev = resolve_device(device)
    tdtype: torch.dtype = resolve_dtype(
        {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype), dev)
    return {"device": str(dev), "dtype": str(tdtype).replace("torch.", ""),
            "backends": backend_report(cfg, dev, tdtype)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpage inspect", description=__doc__.splitlines()[0])
    add_inspect_arguments(parser)
    return run_inspect(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
