"""Our Triton kernels as an attention backend.

Per layer: the KV-cache write kernel, then the paged decode kernel for the leading
decode requests and the FlashAttention-style paged prefill kernel for the rest (prompt
chunks and prefix hits), both reading K/V through the block tables. Llama 4's chunked
layers hand both kernels their ``chunk_size`` (the chunk start: one more lower bound on a
query's keys, as a sliding window's edge).

MLA: the latent-cache write kernel; decodes run the MLA decode kernel over the latent
cache (absorbed queries, MQA over 576-wide entries); prompt chunks and prefix hits run
the prefill kernel over the latents expanded into per-head K (qk dim nope + rope, 192)
and V (128) by kernels/mla_expand.py (a gather kernel, kv_b_proj's matmul, a copy kernel). The decode part (write + decode kernel) has static shapes
and no host sync, so DeepSeek decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import torch

from flashpage import envs
from flashpage.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from flashpage.config import ModelConfig

# Head dims the attention kernels take: multiples of 8 from 32 to 256. A dim that is no
# power of two (Phi-2's 80, GPT-NeoX-20B's 96) is padded to the next one in registers, the
# padding columns masked on every load and store (kernels/flash_prefill.py, paged_decode.py);
# the Gluon kernels take 128 only and step aside for the others.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 32, 256, 8


def head_dim_reason(head_dim: int) -> str | None:
    """Why the Triton attention kernels cannot take ``head_dim``; None if they can."""
    if MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0:
        return None
    return (f"head_dim {head_dim} is not a multiple of {HEAD_DIM_MULTIPLE} from "
            f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_prefill_graphs = True  # MLA's prompt path is not (the model opts out)

    @classmethod
    def unsupported_reasons(cls, model_config: ModelConfig, device: torch.device,
                            dtype: torch.dtype, *,
                            kv_cache_dtype: torch.dtype | None = None) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed")
        if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
            reasons.append(f"needs a CUDA GPU (device is {device.type}; "
                           "TRITON_INTERPRET=1 runs it on the CPU, slowly)")
        if not model_config.is_mla and (why := head_dim_reason(model_config.head_dim)):
            reasons.append(why)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"dtype {dtype} is not supported")
        if kv_cache_dtype not in (None, dtype, torch.float8_e4m3fn):
            reasons.append(f"KV cache dtype {kv_cache_dtype} is not supported")
        return reasons

    def __init__(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_config, device, dtype)
        # the KV caches' TMA descriptors (Gluon kernels), made once for the engine's life
        self.descriptors: dict = {}

    def prepare(self, md: AttentionMetadata) -> AttentionMetadata:
        nd = md.num_decodes
        if md.num_seqs > nd:
            # Offsets of the non-decode part, starting at 0.
            md.extra["prefill_qsl"] = md.query_start_loc[nd:] - md.num_decode_tokens
            md.extra["prefill_max_q"] = max(md.query_lens_cpu[nd:])
            md.extra["prefill_max_k"] = max(md.seq_lens_cpu[nd:])
            if self.model_config.is_mla:
                # MLA expands each request's whole context back to back: its offsets.
                cu_k = torch.zeros(md.num_seqs - nd + 1, dtype=torch.int32, device=self.device)
                torch.cumsum(md.seq_lens[nd:], 0, out=cu_k[1:])
                md.extra["prefill_cu_k"] = cu_k
                md.extra["prefill_total_k"] = sum(md.seq_lens_cpu[nd:])
        return md

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, *, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None, write_kv: bool = True,
                sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
        from flashpage.kernels.cache_write import write_kv_cache
        from flashpage.kernels.flash_prefill import PrefillPlan
        from flashpage.kernels.paged_decode import DecodePlan
        from flashpage.kernels.plan import planned

        key_cache, value_cache = kv_cache
        md = metadata
        n = md.num_actual_tokens
        if write_kv:
            write_kv_cache(k[:n], v[:n], key_cache, value_cache, md.slot_mapping[:n])
        out = torch.empty_like(q)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        # Each kernel planned once a step, by its first layer; later layers only launch
        # (kernels/plan.py): the step's tables, lengths and geometry are every layer's. A
        # layer with another window or softcap (Gemma 2/3's windowed and global layers) gets
        # a plan of its own; so does one with other ALiBi slopes (a plan holds its slopes
        # tensor: keyed by its address, one for all layers of a model, layers/alibi.py).
        # Sinks are each layer's own: a plan takes them at launch (kernels/plan.py), so the
        # key says only whether there are any. Llama 4's chunked layers and its full ones
        # (chunk_size None) get a plan each.
        opts = (sliding_window, scale, softcap,
                None if alibi_slopes is None else alibi_slopes.data_ptr(), sinks is not None,
                chunk_size)
        if nd:
            qd, od = q[:nd], out[:nd]
            planned(md.extra, ("decode", *opts), lambda: DecodePlan(
                qd, key_cache, value_cache, md.block_tables[:nd], md.seq_lens[:nd], sm_scale=scale,
                window_size=sliding_window, out=od, descriptors=self.descriptors, softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks, chunk_size=chunk_size), qd, key_cache,
                value_cache, od, sinks=sinks)
        if md.num_seqs > nd:
            qp, op = q[ndt:n], out[ndt:n]
            planned(md.extra, ("prefill", *opts), lambda: PrefillPlan(
                qp, key_cache, value_cache, md.block_tables[nd:], md.extra["prefill_qsl"],
                md.seq_lens[nd:], md.extra["prefill_max_q"], md.extra["prefill_max_k"], causal=True,
                sm_scale=scale, window_size=sliding_window, out=op, descriptors=self.descriptors,
                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, chunk_size=chunk_size), qp,
                key_cache, value_cache, op, sinks=sinks)
        return out

    def write_mla_cache(self, latent: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        """latent [N, R + rope] into slots ``slot_mapping`` [N] (-1 skipped); no host sync."""
        from flashpage.kernels.cache_write import write_mla_cache

        write_mla_cache(latent, kv_cache, slot_mapping)

    def expand_mla_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                           kv_b_proj_weight: torch.Tensor, md: AttentionMetadata, *, num_heads: int,
                           qk_nope_head_dim: int, v_head_dim: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The non-decode requests' q, K and V (layers/mla_attention.mla_expand_prefill_torch's
        contract and values): the gather and copy kernels of kernels/mla_expand.py around
        kv_b_proj's matmul, planned once a step by the first layer; later layers only launch."""
        from flashpage.kernels.mla_expand import MLAExpandPlan

        if kv_b_proj_weight.dtype != q_nope.dtype:  # not a 16-bit matrix: the torch path
            from flashpage.layers.mla_attention import mla_expand_prefill_torch

            return mla_expand_prefill_torch(q_nope, q_pe, kv_cache, kv_b_proj_weight, md,
                                            num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                                            v_head_dim=v_head_dim)
        plan = md.extra.get("mla_expand")
        if plan is None or not plan.fits(kv_cache, kv_b_proj_weight, q_nope, q_pe):
            nd = md.num_decodes
            plan = md.extra["mla_expand"] = MLAExpandPlan(
                kv_cache, md.block_tables[nd:], md.seq_lens[nd:], md.extra["prefill_cu_k"],
                md.extra["prefill_total_k"], md.extra["prefill_max_k"], kv_b_proj_weight, q_nope,
                q_pe, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)
        return plan.run(kv_cache, kv_b_proj_weight, q_nope, q_pe)

    def forward_mla_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            md: AttentionMetadata, *, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
        """The non-decode requests: q [Nq, H, nope + rope] their new tokens; k [Nk, H,
        nope + rope], v [Nk, H, v_dim] their whole expanded contexts (lengths
        ``seq_lens[num_decodes:]``) -> [Nq, H, v_dim] (into ``out`` where given: contiguous),
        bottom-right causal. Planned once a step by the first layer (kernels/plan.py); later
        layers only launch."""
        from flashpage.kernels.flash_prefill import VarlenPlan
        from flashpage.kernels.plan import planned

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if out is None:
            out = q.new_empty(*q.shape[:2], v.shape[-1])
        cu_q, cu_k = md.extra["prefill_qsl"], md.extra["prefill_cu_k"]
        max_q, max_k = md.extra["prefill_max_q"], md.extra["prefill_max_k"]
        planned(md.extra, ("mla_prefill", scale), lambda: VarlenPlan(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, sm_scale=scale, out=out), q, k, v, out)
        return out

    def forward_mla_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                           *, kv_lora_rank: int, scale: float) -> torch.Tensor:
        """q [nd, H, R + rope] absorbed queries of the leading decodes -> [nd, H, R]. The
        kernel (envs.mla_gluon), its splits, scratch and launch are planned once a step, by
        the first layer (kernels/plan.py); later layers only launch."""
        from flashpage.kernels.mla_decode import MLADecodePlan
        from flashpage.kernels.plan import planned

        nd, h = q.shape[0], q.shape[1]
        q = q.contiguous()
        out = q.new_empty(nd, h, kv_lora_rank)
        tables, lens = md.block_tables[:nd], md.seq_lens[:nd]

        def make() -> MLADecodePlan:
            kernel = envs.mla_gluon()
            if kernel == "auto":  # the wgmma kernel for one 16-head group, else Triton's
                kernel = "wgmma" if h == 16 else ""
            if kernel:
                from flashpage.kernels import mla_decode_gluon as mg

                if mg.mla_gluon_unsupported(q, kv_cache, tables, lens, kv_lora_rank=kv_lora_rank):
                    kernel = ""
            return MLADecodePlan(q, kv_cache, tables, lens, kv_lora_rank=kv_lora_rank, sm_scale=scale,
                                 out=out, kernel=kernel, descriptors=self.descriptors)

        planned(md.extra, ("mla_decode", kv_lora_rank, scale), make, q, kv_cache, kv_cache, out)
        return out
