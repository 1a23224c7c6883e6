"""A Llama checkpoint written in InternLM2's remote-code layout (InternLM2ForCausalLM:
transformers has no InternLM2 class, so the reference is the Llama model it renames), for
the text-model and InternVL tests.

InternLM2's names: model.tok_embeddings, attention.wqkv (q, k and v fused with rows grouped
per KV head: each group's heads / kv_heads q heads, then its k head, then its v head),
attention.wo, attention_norm, ffn_norm, feed_forward.w1 (gate) / w3 (up) / w2 (down),
model.norm, output (the head); its config's ``bias`` is Llama's attention_bias (wqkv and wo)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

# Llama's module names -> InternLM2's (after the language model's prefix)
_RENAMES = ((r"^model\.embed_tokens\.", "model.tok_embeddings."), (r"^lm_head\.", "output."),
            (r"\.self_attn\.o_proj\.", ".attention.wo."), (r"\.input_layernorm\.", ".attention_norm."),
            (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
            (r"\.mlp\.up_proj\.", ".feed_forward.w3."), (r"\.mlp\.down_proj\.", ".feed_forward.w2."))


def grouped_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Llama's q / k / v rows (weights [rows, K] or biases [rows]) as InternLM2's wqkv:
    [q(0..g-1) k0 v0 | q(g..2g-1) k1 v1 | ...], written the way its remote code reads it
    back (``(h gs d)`` with gs = g + 2)."""
    d = k.shape[0] // kv_heads
    rest = q.shape[1:]
    g = q.shape[0] // (kv_heads * d)
    parts = [q.reshape(kv_heads, g, d, *rest), k.reshape(kv_heads, 1, d, *rest), v.reshape(kv_heads, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def internlm2_tensors(tensors: dict[str, torch.Tensor], kv_heads: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """A Llama state dict's tensors under ``prefix`` (``language_model.`` in an InternVL
    checkpoint; others pass as they are) in InternLM2's names and wqkv layout."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            out[name] = t
            continue
        rest = name[len(prefix):]
        if re.search(r"\.self_attn\.[kv]_proj\.", rest):
            continue
        if ".self_attn.q_proj." in rest:
            qkv = [tensors[name.replace(".q_proj.", f".{p}.")] for p in ("q_proj", "k_proj", "v_proj")]
            out[prefix + rest.replace(".self_attn.q_proj.", ".attention.wqkv.")] = grouped_wqkv(*qkv, kv_heads)
            continue
        for pat, rep in _RENAMES:
            rest = re.sub(pat, rep, rest)
        out[prefix + rest] = t.contiguous()
    return out


def internlm2_config(llama: dict) -> dict:
    """A LlamaConfig's fields as an InternLM2 config.json's (InternLM2Config's names)."""
    c = {k: v for k, v in llama.items()
         if k not in ("attention_bias", "mlp_bias", "head_dim", "architectures", "rope_parameters")}
    rope = dict(llama.get("rope_parameters") or {})  # transformers 5's -> rope_theta / rope_scaling
    if rope:
        c["rope_theta"] = rope.pop("rope_theta", 10_000.0)
        kind = rope.pop("rope_type", "default")
        c["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return {**c, "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
            "bias": bool(llama.get("attention_bias", False)),
            "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                         "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}}


def to_internlm2(src: Path, dst: Path) -> Path:
    """The Llama checkpoint folder ``src`` in InternLM2's layout at ``dst``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    llama = json.loads((src / "config.json").read_text())
    kv = llama.get("num_key_value_heads") or llama["num_attention_heads"]
    save_file(internlm2_tensors(load_file(str(src / "model.safetensors")), kv), str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(internlm2_config(llama)))
    return dst
