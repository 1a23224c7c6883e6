"""The Llama head for families whose checkpoints fuse q, k and v into one
``query_key_value`` laid out per KV group (GPT-NeoX, Falcon; models/common.regroup_qkv):
regrouped into our ``qkv_proj`` at load, with its quantized tensors (per-row / per-group
scales and zeros; block scales where a head is whole blocks, the linear dequantized
otherwise), and back in ``hf_weights``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from flashpage.models.common import fused_qkv_block_unsupported, regroup_fused_qkv, regroup_qkv
from flashpage.models.llama import LlamaForCausalLM


class FusedQKVForCausalLM(LlamaForCausalLM):
    # the fused tensors' checkpoint names (their weight, bias and FUSED_QKV_TENSORS' scales)
    qkv_tensor: re.Pattern[str]

    def _skipped(self, name: str) -> bool:
        """A checkpoint tensor read past (GPT-NeoX's attention mask buffers)."""
        return False

    def _shards(self) -> dict[str, tuple[str, int, int]]:
        return {}  # nothing to stack: query_key_value is our qkv_proj, once regrouped

    def _regrouped(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        c, qc = self.config, self.config.quantization_config
        heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bn = qc.block_size[0] if qc is not None and qc.block_size is not None else None
        layout = (f"3 x {heads} heads x {d}" if kv == heads
                  else f"({heads} query + 2 x {kv} KV heads) x {d}")
        for name, t in weights:
            if self._skipped(name):
                continue
            if self.qkv_tensor.search(name):
                t = regroup_fused_qkv(name, t, heads, kv, d, bn, layout)
            yield name, t

    def fp8_block_unsupported(self, linear: str, block: tuple[int, int]) -> str | None:
        """query_key_value's block scales only where a head is whole blocks (or one KV
        group, MQA: not regrouped)."""
        if not self.qkv_tensor.search(linear + ".weight"):
            return None
        return fused_qkv_block_unsupported(linear, self.config.num_key_value_heads,
                                           self.config.head_dim, block)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._regrouped(weights))

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """Llama's, and query_key_value: the whole qkv_proj (an adapter's lora_B rows
        regrouped as the weight's, lora_b_to_ours)."""
        out = super().lora_targets()
        self._qkv_target(out)
        return out

    def lora_b_to_ours(self, module: str, b: torch.Tensor) -> torch.Tensor:
        if not self.qkv_tensor.search(module + ".weight"):
            return b
        c = self.config
        return regroup_qkv(b, c.num_key_value_heads, c.head_dim, to_ours=True)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The parameters under the checkpoint's names, query_key_value's rows per KV group
        again."""
        c = self.config
        for name, t in super().hf_weights():
            yield name, (regroup_qkv(t, c.num_key_value_heads, c.head_dim, to_ours=False)
                         if self.qkv_tensor.search(name) else t)
