"""EleutherAI's GPT-J (GPTJForCausalLM): Phi-1/1.5/2's model (models/phi.py: one LayerNorm
with bias a layer whose output attention and the MLP both read, x + attn(h) + mlp(h); a
non-gated biased MLP; an LM head WITH a bias) under GPT-J's names, with:

- q_proj, k_proj, v_proj and out_proj without bias (stacked into our ``qkv_proj`` as
  Llama's; out_proj is our o_proj);
- rotary on the first ``rotary_dim`` dims of each head on interleaved pairs (x[2i],
  x[2i + 1]: transformers' rotate_every_two, config.rope_interleaved as Cohere's), base
  10000; the rest of the head passes through;
- fc_in -> GELU (``activation_function``, gelu_new) -> fc_out, biased (our c_fc / c_proj).

Our names are Llama's (``model.layers.N.self_attn.qkv_proj``); the checkpoint's
(``transformer.h.N.attn.q_proj``) come back from ``hf_weights``, ``lora_targets`` and
``hf_name``. EleutherAI's files hold the causal-mask buffers ``attn.bias`` and
``attn.masked_bias``, read past as transformers does."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from flashpage.models.common import HFNames
from flashpage.models.phi import PhiForCausalLM

NAMES = HFNames({
    "transformer.wte": "model.embed_tokens",
    "transformer.ln_f": "model.norm",
    "transformer.h.{}.ln_1": "model.layers.{}.input_layernorm",
    "transformer.h.{}.attn.out_proj": "model.layers.{}.self_attn.o_proj",
    "transformer.h.{}.attn": "model.layers.{}.self_attn",  # q_proj, k_proj, v_proj
    "transformer.h.{}.mlp.fc_in": "model.layers.{}.mlp.c_fc",
    "transformer.h.{}.mlp.fc_out": "model.layers.{}.mlp.c_proj",
    "transformer.h.{}.mlp": "model.layers.{}.mlp",
})
_MASK_BUFFERS = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")


class GPTJForCausalLM(PhiForCausalLM):
    hf_names = NAMES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not _MASK_BUFFERS.match(n))
