"""InternLM2 / InternLM2.5 (InternLM2ForCausalLM, OpenGVLab's and InternLM's remote code;
InternVL2.5-8B's and InternVL2-8B's text model): Llama's layer, head and loading
(models/llama.py) under InternLM2's names (models/common.HFNames)::

    model.tok_embeddings                 model.embed_tokens
    model.layers.N.attention.wqkv        model.layers.N.self_attn.qkv_proj
    model.layers.N.attention.wo          model.layers.N.self_attn.o_proj
    model.layers.N.attention_norm        model.layers.N.input_layernorm
    model.layers.N.ffn_norm              model.layers.N.post_attention_layernorm
    model.layers.N.feed_forward.w1/w3/w2 model.layers.N.mlp.gate_proj/up_proj/down_proj
    output                               lm_head

with one difference in layout: ``wqkv``'s rows are grouped per KV head, each group its
num_heads / num_kv_heads q heads, then its k head, then its v head (the remote code's
``rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + heads // kv_heads)``, q the first
gs - 2, k the one before last, v the last)::

    checkpoint  [q0 .. q(g-1) k0 v0 | qg .. q(2g-1) k1 v1 | ...]   (head_dim rows each)
    ours        [q0 q1 ... | k0 k1 ... | v0 v1 ...]

which is Falcon-40B's query_key_value: regrouped into our qkv_proj at load and back in
``hf_weights`` by models/fused_qkv.py (a wqkv of the wrong row count is a ValueError
naming it and the layout), so the KV cache, the kernels and Llama's q / k / v split do
not change. ``bias`` (config.py _internlm_fields) biases wqkv and wo, as transformers'
Llama's attention_bias biases q/k/v and o_proj. LoRA targets: wqkv (the whole qkv_proj),
wo, w1, w3, w2.

InternLM3 (InternLM3ForCausalLM) has Llama's own names: models/llama.py serves it, with
its bias flags read in config.py."""

from __future__ import annotations

import re

from flashpage.models.common import FUSED_QKV_TENSORS, HFNames
from flashpage.models.fused_qkv import FusedQKVForCausalLM
from flashpage.models.llama import LlamaForCausalLM

NAMES = HFNames({
    "model.tok_embeddings": "model.embed_tokens",
    "output": "lm_head",
    "model.layers.{}.attention.wqkv": "model.layers.{}.self_attn.qkv_proj",
    "model.layers.{}.attention.wo": "model.layers.{}.self_attn.o_proj",
    "model.layers.{}.attention_norm": "model.layers.{}.input_layernorm",
    "model.layers.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "model.layers.{}.feed_forward.w1": "model.layers.{}.mlp.gate_proj",
    "model.layers.{}.feed_forward.w3": "model.layers.{}.mlp.up_proj",
    "model.layers.{}.feed_forward.w2": "model.layers.{}.mlp.down_proj",
})
_WQKV = re.compile(r"\.attention\.wqkv" + FUSED_QKV_TENSORS)


class InternLM2ForCausalLM(FusedQKVForCausalLM):
    """The Llama body (LlamaModel, gated MLP); only the names and wqkv's rows differ."""

    hf_names = NAMES
    qkv_tensor = _WQKV

    def _shards(self) -> dict[str, tuple[str, int, int]]:
        """Llama's gate/up pieces (w1, w3 once renamed); not q/k/v: wqkv is qkv_proj whole."""
        return {hf: t for hf, t in LlamaForCausalLM._shards(self).items()
                if not hf.startswith("self_attn.")}
