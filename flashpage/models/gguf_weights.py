"""A GGUF file's tensors as (HF name, fp32 tensor) pairs, undoing what llama.cpp's
convert_hf_to_gguf.py did to each family's checkpoint, so the models load them as they
load safetensors (models/loader.py). The config side is models/gguf_config.py's.

Names: llama.cpp's (gguf-py's tensor_mapping.py) back to HF's, per GGUF architecture
where they differ: ``ffn_norm`` is Gemma 2/3's pre_feedforward_layernorm (their
post_attention_layernorm is ``post_attention_norm``), Phi-3's fused ``ffn_up`` is
gate_up_proj (and ``attn_qkv`` qkv_proj), StarCoder2's ``ffn_up`` / ``ffn_down`` are
c_fc / c_proj, Granite MoE's ``ffn_gate_inp`` its router and ``ffn_down_shexp`` its shared
MLP's output_linear; Phi-2's, GPT-NeoX's, GPT-2's, Falcon's, Bloom's, MPT's, StarCoder's and
GPT-J's under their own names (_ARCH_TOP_NAMES).

Values, as the converter changed them:

- llama / mistral (Mixtral too), granite / granitemoe, olmo: q/k rows permuted into
  interleaved rope pairs (their biases too, but OLMo's); undone (Command-R / Cohere2 rotate interleaved pairs in
  transformers too, and OLMo2 / OLMoE halves in llama.cpp too: stored as they are);
- gptneox: ``attn_qkv`` rows [q; k; v] (GPTNeoXModel's reorder); regrouped per head
  again, as GPT-NeoX's query_key_value holds them (models/common.regroup_qkv);
- bloom: ``attn_qkv`` rows [q; k; v] (BloomModel's reorder, GPT-NeoX's); regrouped per head
  again, as Bloom's query_key_value holds them; ``output.weight``, the converter's copy of
  the tied embeddings, skipped when the config reads the head as tied;
- mpt, starcoder, gptj: stored as they are (MPT's Wqkv is [q | k | v], StarCoder's
  multi-query c_attn [q; k; v], both ours; GPT-J's q/k rows unpermuted);
- falcon: ``attn_qkv`` rows [q; k; v] (FalconModel's "jploski" layout); regrouped per KV
  group again, as Falcon's query_key_value holds them;
- gpt2: the Conv1D weights (c_attn, c_proj, c_fc) transposed back to [in, out];
- phi2: an older file's fused ``attn_qkv`` split into q / k / v rows;
- granitemoe: the experts' ``input_linear`` split into ``ffn_{gate,up}_exps`` (stacked
  experts below) and the shared MLP's into ``ffn_{gate,up}_shexp``; the latter joined again;
- Gemma 1/2/3: every ``*norm.weight`` stored as 1 + w (transformers' GemmaRMSNorm scales by
  1 + w, llama.cpp's by the weight); the 1 is taken off again (models/gemma.py adds it);
- MoE (Mixtral under ``llama``, ``qwen2moe``, ``qwen3moe``): each layer's experts stacked
  into ``ffn_{gate,up,down}_exps`` [experts, out, in] (``ffn_gate_up_exps``: gate and up
  rows concatenated, the converter's --fuse-gate-up-exps); split back into one
  ``mlp.experts.{e}.{gate,up,down}_proj.weight`` view per expert (no copy);
- Phi-3's ``rope_factors_long`` / ``rope_factors_short`` are config (models/gguf_config.py),
  skipped here; Llama 3.1's ``rope_freqs`` goes to the rotary caches as ``rope_freqs``.

Qwen2 / Qwen3 / Phi-3 / StarCoder2 / Gemma q/k rows are stored as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from flashpage.config import ModelConfig
from flashpage.models.common import regroup_qkv
from flashpage.models.gguf_file import GGUFTensor
from flashpage.models.loader import ModelLoadError

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
# blk.{i}.<key> -> model.layers.{i}.<value> (.weight / .bias kept), every architecture's
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# ... and where an architecture's differ
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "granitemoe": {"ffn_gate_inp": "block_sparse_moe.router.layer",
                   "ffn_down_shexp": "shared_mlp.output_linear"},
}
# where an architecture's HF names differ wholly: (top-level names, the layers' prefix,
# their names); GPT-NeoX's qkv rows are also regrouped (iter_gguf)
_ARCH_TOP_NAMES = {
    "phi2": {"output_norm.weight": "model.final_layernorm.weight",
             "output_norm.bias": "model.final_layernorm.bias", "output.bias": "lm_head.bias"},
    "gptneox": {"token_embd.weight": "gpt_neox.embed_in.weight",
                "output_norm.weight": "gpt_neox.final_layer_norm.weight",
                "output_norm.bias": "gpt_neox.final_layer_norm.bias",
                "output.weight": "embed_out.weight"},
    "gpt2": {"token_embd.weight": "transformer.wte.weight",
             "position_embd.weight": "transformer.wpe.weight",
             "output_norm.weight": "transformer.ln_f.weight",
             "output_norm.bias": "transformer.ln_f.bias"},
    "falcon": {"token_embd.weight": "transformer.word_embeddings.weight",
               "output_norm.weight": "transformer.ln_f.weight",
               "output_norm.bias": "transformer.ln_f.bias"},
}
_ARCH_TOP_NAMES.update({
    "bloom": {"token_embd.weight": "transformer.word_embeddings.weight",
              "token_embd_norm.weight": "transformer.word_embeddings_layernorm.weight",
              "token_embd_norm.bias": "transformer.word_embeddings_layernorm.bias",
              "output_norm.weight": "transformer.ln_f.weight",
              "output_norm.bias": "transformer.ln_f.bias"},
    "mpt": {"token_embd.weight": "transformer.wte.weight",
            "output_norm.weight": "transformer.norm_f.weight",
            "output_norm.bias": "transformer.norm_f.bias"},
    "gptj": {"token_embd.weight": "transformer.wte.weight",
             "output_norm.weight": "transformer.ln_f.weight",
             "output_norm.bias": "transformer.ln_f.bias", "output.bias": "lm_head.bias"},
})
_ARCH_TOP_NAMES["starcoder"] = _ARCH_TOP_NAMES["gpt2"]
_LAYER_PREFIX = {"gptneox": "gpt_neox.layers", "gpt2": "transformer.h", "falcon": "transformer.h",
                 "bloom": "transformer.h", "mpt": "transformer.blocks", "starcoder": "transformer.h",
                 "gptj": "transformer.h"}
_ARCH_LAYER_NAMES.update({
    "phi2": {"attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
    "gptneox": {"attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
    "gpt2": {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    # Falcon-40B's two norms: gguf-py maps ln_mlp to attn_norm and ln_attn to attn_norm_2
    # (llama.cpp's attention reads attn_norm_2 where there is one); attn_norm is
    # input_layernorm where it is alone (iter_gguf)
    "falcon": {"attn_norm_2": "ln_attn", "attn_qkv": "self_attention.query_key_value",
               "attn_output": "self_attention.dense", "ffn_up": "mlp.dense_h_to_4h",
               "ffn_down": "mlp.dense_4h_to_h"},
    "bloom": {"attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
              "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
    "mpt": {"attn_norm": "norm_1", "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj",
            "ffn_norm": "norm_2", "ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj"},
    "gptj": {"attn_norm": "ln_1", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj",
             "attn_v": "attn.v_proj", "attn_output": "attn.out_proj", "ffn_up": "mlp.fc_in",
             "ffn_down": "mlp.fc_out"},
})
_ARCH_LAYER_NAMES["starcoder"] = _ARCH_LAYER_NAMES["gpt2"]  # nn.Linear: not transposed
# GPT-2's Conv1D weights ([in, out]), which GPT2Model transposed
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
# Granite MoE's shared MLP: the converter splits its input_linear (gate rows, then up);
# joined again
_GRANITE_SHARED = ("ffn_gate_shexp", "ffn_up_shexp")
# stacked experts: blk.{i}.<key>.weight -> the projections it holds
_EXPERTS = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",),
            "ffn_down_exps": ("down_proj",), "ffn_gate_up_exps": ("gate_proj", "up_proj")}
# llama.cpp permutes q/k for these (LlamaModel.permute; GraniteModel is a LlamaModel,
# OlmoModel permutes as it does)
_PERMUTED = ("llama", "mistral", "granite", "granitemoe", "olmo")
_BIAS_KEPT = ("olmo",)  # OlmoModel permutes the q/k weights only, LlamaModel their biases too
_GEMMA = ("gemma", "gemma2", "gemma3")  # norms stored as 1 + w
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF's halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGML block types dequantized in torch here (the default model's Q4_1 and Q8_0 tensors:
# 0.93 s in gguf's numpy code, 0.47 s here): name -> bytes per block of 32 values.
_TORCH_QUANTS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize_gguf(data: np.ndarray, qtype: str) -> torch.Tensor | None:
    """A GGUF tensor's raw data (as models/gguf_file gives it) as fp32, flat, for F32,
    F16, Q4_0, Q4_1 and Q8_0 (blocks of 32 values, an fp16 scale d first; Q4_1 an fp16
    minimum m after it; 4-bit quants low nibbles first): d * q (Q4_0: d * (q - 8); Q4_1:
    d * q + m), the arithmetic of gguf.quants, so the result is equal to the bit. None for
    any other type."""
    # np.array copies out of the read-only memory map (torch wants writable arrays).
    if qtype == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(-1)
    if qtype == "F16":
        return torch.from_numpy(np.array(data)).reshape(-1).float()
    if qtype not in _TORCH_QUANTS:
        return None
    blocks = torch.from_numpy(np.array(data).reshape(-1)).view(-1, _TORCH_QUANTS[qtype])
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        return (d * blocks[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)
    qs = blocks[:, 4:] if qtype == "Q4_1" else blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
    if qtype == "Q4_0":
        return (d * (q - 8.0)).reshape(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(-1)


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF name of a GGUF tensor that maps one to one (None: stacked experts, config
    tensors, or a name we do not know)."""
    top = _ARCH_TOP_NAMES.get(arch, {})
    if gguf_name in top or gguf_name in _TOP_NAMES:
        return top.get(gguf_name) or _TOP_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return "rope_freqs"  # llama.cpp stores Llama 3.1's rope scaling as frequency factors
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdecimal():
        return None
    _, layer, key, kind = parts
    key = _ARCH_LAYER_NAMES.get(arch, {}).get(key) or _LAYER_NAMES.get(key) or ""
    if not key or kind not in ("weight", "bias"):
        return None
    return f"{_LAYER_PREFIX.get(arch, 'model.layers')}.{layer}.{key}.{kind}"


def _tensor(t: GGUFTensor, path: str) -> torch.Tensor:
    import gguf

    w = dequantize_gguf(t.data, t.tensor_type.name)
    if w is None:  # another type: gguf's numpy dequantizer
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type "
                                 f"{t.tensor_type.name}") from e
        w = torch.from_numpy(np.array(arr, dtype=np.float32))
    return w.reshape(tuple(int(x) for x in reversed(t.shape)))


def iter_gguf(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF file at ``path`` under its HF name, in fp32, as the HF
    checkpoint held it (the module docstring says what is undone). An unknown tensor name
    is a ModelLoadError naming it."""
    from flashpage.models.gguf_config import open_gguf

    try:
        reader = open_gguf(path)
    except Exception as err:
        raise ModelLoadError(f"{path} is corrupt or not a GGUF file: {err}") from err
    arch = str(reader.fields.get("general.architecture", ""))
    shared: dict[tuple[str, str], torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        parts = t.name.split(".")
        if arch == "granitemoe" and len(parts) == 4 and parts[2] in _GRANITE_SHARED:
            shared[parts[1], parts[2]] = _tensor(t, path)
            if all((parts[1], k) in shared for k in _GRANITE_SHARED):
                yield (f"model.layers.{parts[1]}.shared_mlp.input_linear.weight",
                       torch.cat([shared.pop((parts[1], k)) for k in _GRANITE_SHARED]))
            continue
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERTS and parts[3] == "weight":
            stacked = _tensor(t, path)  # [experts, rows, cols]
            projs = _EXPERTS[parts[2]]
            rows = stacked.shape[1] // len(projs)
            for e in range(stacked.shape[0]):
                for i, proj in enumerate(projs):
                    yield (f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.weight",
                           stacked[e, i * rows:(i + 1) * rows])
            continue
        name = _hf_name(t.name, arch)
        if name is None:
            raise ModelLoadError(f"{path}: unknown GGUF tensor {t.name!r} (architecture {arch!r})")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # Bloom's copy of token_embd (gguf_config read it as tied)
        w = _tensor(t, path)
        if arch == "phi2" and parts[2:3] == ["attn_qkv"]:  # older Phi-2 files: q, k, v rows
            for proj, part in zip("qkv", w.chunk(3), strict=True):
                yield name.replace("qkv_proj", f"{proj}_proj"), part
            continue
        if arch in ("gptneox", "bloom") and parts[2:3] == ["attn_qkv"]:
            # GPTNeoXModel / BloomModel wrote [q; k; v]; HF holds [q0 k0 v0 | q1 k1 v1 | ...]
            # per head
            heads = config.num_attention_heads
            w = regroup_qkv(w, heads, w.shape[0] // (3 * heads), to_ours=False)
        elif arch == "falcon" and parts[2:3] == ["attn_qkv"]:
            # FalconModel wrote [q; k; v]; HF holds each KV group's q heads, then its k, v
            w = regroup_qkv(w, config.num_key_value_heads, config.head_dim, to_ours=False)
        elif arch == "falcon" and parts[2:3] == ["attn_norm"] and config.parallel_norms == 2:
            name = name.replace(".input_layernorm.", ".ln_mlp.")
        elif arch == "gpt2" and parts[2:3] != [] and parts[2] in _GPT2_CONV1D and parts[3] == "weight":
            w = w.t().contiguous()
        if arch in _BIAS_KEPT and name.endswith("_proj.bias"):
            pass
        elif arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rope(w, config.num_attention_heads)
        elif arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rope(w, config.num_key_value_heads)
        elif arch in _GEMMA and name.endswith("norm.weight"):
            w = w - 1.0
        yield name, w
    if shared:
        raise ModelLoadError(f"{path}: {', '.join(f'blk.{i}.{k}.weight' for i, k in shared)} "
                             "without its other half of Granite MoE's shared MLP "
                             f"({' + '.join(_GRANITE_SHARED)})")
