"""Phi-3 / Phi-3.5-mini / Phi-4-mini (Phi3ForCausalLM): the Llama body (models/llama.py)
whose checkpoints already hold the merged projections, ``self_attn.qkv_proj`` and
``mlp.gate_up_proj`` (our parameter names: they load as they are, and ``hf_weights``
gives them back so); rotary over the first ``partial_rotary_factor`` of each head
(Phi-4-mini: 3/4) and longrope scaling (layers/rotary.py: the long factors when
max_model_len > original_max_position_embeddings, as vLLM; the short ones otherwise),
an optional sliding window, tied or untied embeddings (Phi-4-mini ties them)."""

from __future__ import annotations

import logging

from flashpage.config import ModelConfig
from flashpage.layers.rotary import uses_long_factors
from flashpage.models.llama import LlamaForCausalLM

logger = logging.getLogger("flashpage")


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions)
        rs, n = config.rope_scaling, max_positions or config.max_position_embeddings
        if rs is not None and rs.rope_type == "longrope":
            original = rs.original_max_position_embeddings
            if uses_long_factors(rs, n):
                logger.info("longrope: the long factors, for max_model_len %d > %s (the short "
                            "ones, better within it, take max_model_len <= %s)", n, original,
                            original)
            else:
                logger.info("longrope: the short factors (max_model_len %d <= %s)", n, original)

    def _shards(self) -> dict[str, tuple[str, int, int]]:
        return {}  # nothing to stack: the checkpoint's qkv_proj / gate_up_proj are ours

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """Phi-3's adapters name the merged linears (qkv_proj, gate_up_proj) themselves."""
        c = self.config
        out = super().lora_targets()  # o_proj, down_proj
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            out[f"{p}.self_attn.qkv_proj"] = (f"{p}.self_attn.qkv_proj", 0, qkv)
            out[f"{p}.mlp.gate_up_proj"] = (f"{p}.mlp.gate_up_proj", 0, 2 * c.intermediate_size)
        return out
