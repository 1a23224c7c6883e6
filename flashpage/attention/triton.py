"""Our Triton kernels as an attention backend.

Per layer: the KV-cache write kernel, then the paged decode kernel for the leading
decode requests and the FlashAttention-style paged prefill kernel for the rest (prompt
chunks and prefix hits), both reading K/V through the block tables.

MLA: decodes run the MLA decode kernel over the latent cache (absorbed queries, MQA
over 576-wide entries); prompt chunks use the layer's expanded torch path.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import torch

from flashpage.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from flashpage.config import ModelConfig

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    @classmethod
    def unsupported_reasons(cls, model_config: ModelConfig, device: torch.device,
                            dtype: torch.dtype) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed")
        if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
            reasons.append(f"needs a CUDA GPU (device is {device.type}; "
                           "TRITON_INTERPRET=1 runs it on the CPU, slowly)")
        if not model_config.is_mla and model_config.head_dim not in SUPPORTED_HEAD_DIMS:
            reasons.append(f"head_dim {model_config.head_dim} is not one of {SUPPORTED_HEAD_DIMS}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"dtype {dtype} is not supported")
        return reasons

    def prepare(self, md: AttentionMetadata) -> AttentionMetadata:
        nd = md.num_decodes
        if md.num_seqs > nd:
            # Offsets of the non-decode part, starting at 0.
            md.extra["prefill_qsl"] = md.query_start_loc[nd:] - md.num_decode_tokens
            md.extra["prefill_max_q"] = max(md.query_lens_cpu[nd:])
            md.extra["prefill_max_k"] = max(md.seq_lens_cpu[nd:])
        return md

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, *, scale: float,
                sliding_window: int | None = None, write_kv: bool = True) -> torch.Tensor:
        from flashpage.kernels.cache_write import write_kv_cache
        from flashpage.kernels.flash_prefill import paged_prefill
        from flashpage.kernels.paged_decode import paged_decode

        key_cache, value_cache = kv_cache
        md = metadata
        n = md.num_actual_tokens
        if write_kv:
            write_kv_cache(k[:n], v[:n], key_cache, value_cache, md.slot_mapping[:n])
        out = torch.empty_like(q)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if nd:
            paged_decode(q[:nd], key_cache, value_cache, md.block_tables[:nd], md.seq_lens[:nd],
                         sm_scale=scale, window_size=sliding_window, out=out[:nd])
        if md.num_seqs > nd:
            paged_prefill(q[ndt:n], key_cache, value_cache, md.block_tables[nd:],
                          md.extra["prefill_qsl"], md.seq_lens[nd:],
                          md.extra["prefill_max_q"], md.extra["prefill_max_k"],
                          causal=True, sm_scale=scale, window_size=sliding_window,
                          out=out[ndt:n])
        return out

    def forward_mla_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                           *, kv_lora_rank: int, scale: float) -> torch.Tensor:
        """q [nd, H, R + rope] absorbed queries of the leading decodes -> [nd, H, R]."""
        from flashpage.kernels.mla_decode import mla_decode

        nd = q.shape[0]
        return mla_decode(q.contiguous(), kv_cache, md.block_tables[:nd], md.seq_lens[:nd],
                          kv_lora_rank=kv_lora_rank, sm_scale=scale)
