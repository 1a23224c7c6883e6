"""The attention backend interface and the per-step metadata every backend reads.

A backend has three parts (docs/architecture.md):
1. ``unsupported_reasons``: what it cannot run, as reasons the selector can print;
2. ``prepare``: work done once per step on the shared metadata;
3. ``forward``: called once per attention layer.
MLA backends add ``forward_mla_prefill`` / ``forward_mla_decode``. CUDA-graph capture
and replay go through ``supports_cuda_graphs`` and the fixed-address metadata buffers
the model runner owns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from flashpage.config import ModelConfig


@dataclass
class AttentionMetadata:
    """One flat ragged batch; requests ordered decodes first.

    ::

        query_start_loc  [0, 1, 2, 7, 12]   two decodes, then two 5-token chunks
        seq_lens         [40, 17, 5, 133]   cached prefix + this step's tokens
        block_tables     [num_seqs, max_blocks] int32, padded with 0
        slot_mapping     [num_tokens] int64, -1 = do not write
    """

    num_actual_tokens: int
    num_seqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific, set in prepare()
    # Piecewise CUDA graphs (engine/cuda_graph.PiecewiseGraphs): an attention layer calls
    # split(run, inputs, out_shape) -> out in place of its core, run(md, *inputs) -> out.
    split: Callable[..., torch.Tensor] | None = None
    # KV cache groups (kv_cache/hybrid.py: layers mixing a window with full attention):
    # group g's metadata, its own block tables and slot mapping (groups[0] is this one);
    # an attention layer reads groups[its kv_group]. None: one table for every layer.
    groups: list[AttentionMetadata] | None = None
    # Multimodal inputs whose positions attend both ways (Gemma 3's images,
    # engine/multimodal.py): (request index, first row in the step, rows, their first
    # position, the input's first position, its end), each run's rows recomputed by
    # attention/bidirectional.py after the backend's causal pass. Empty on other steps.
    bidirectional: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)

    def for_group(self, tables: torch.Tensor, slots: torch.Tensor) -> AttentionMetadata:
        """This step's metadata over another group's block tables and slot mapping (the
        backend's prepare to be run on it: its extra is empty)."""
        return AttentionMetadata(
            self.num_actual_tokens, self.num_seqs, self.query_start_loc, self.seq_lens, tables,
            slots, self.max_query_len, self.max_seq_len, self.num_decodes, self.num_decode_tokens,
            self.query_lens_cpu, self.seq_lens_cpu, split=self.split,
            bidirectional=self.bidirectional)


def with_groups(md: AttentionMetadata, others: list[tuple[torch.Tensor, torch.Tensor]],
                prepare: Callable[[AttentionMetadata], AttentionMetadata]) -> AttentionMetadata:
    """``md`` (prepared) with ``groups``: itself, then one metadata per (block tables, slot
    mapping) of the other KV cache groups, each prepared; ``md`` unchanged without others."""
    if others:
        md.groups = [md, *(prepare(md.for_group(t, s)) for t, s in others)]
    return md


def chunked_layers_reason(model_config: ModelConfig, backend: str) -> list[str]:
    """The reason a backend without chunked local attention gives for a model with
    chunked_attention layers (Llama 4), or none."""
    if model_config.attention_chunk_size is None or "chunked_attention" not in model_config.layer_types:
        return []
    return [f"chunked local attention (attention_chunk_size {model_config.attention_chunk_size}: "
            f"Llama 4's chunked_attention layers) is not supported by the {backend} backend "
            "(torch_native and triton run it)"]


class AttentionBackend(ABC):
    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    # Prompt-only steps capturable too: the prefill path has no host syncs and reads only
    # the metadata's device tensors and its max_query_len / max_seq_len bounds.
    supports_prefill_graphs: ClassVar[bool] = False

    def __init__(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.device = device
        self.dtype = dtype

    @classmethod
    @abstractmethod
    def unsupported_reasons(
        cls, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, *,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> list[str]:
        """Why this backend cannot run this model here; empty when it can. ``kv_cache_dtype``:
        the paged K/V cache's dtype (None: ``dtype``; torch.float8_e4m3fn for an fp8 cache)."""

    def bind_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Called once by the model runner when the cache exists."""
        self.num_blocks, self.block_size = num_blocks, block_size

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        return metadata

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        write_kv: bool = True,
        sinks: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D]: write k/v to the cache (unless the caller already
        did, ``write_kv=False``), attend, return [N, Hq, D]. ``sliding_window``: the
        calling layer's (a query at position p sees keys p - window < j <= p);
        ``softcap``: scores (after ``scale``) become softcap * tanh(scores / softcap)
        before the softmax (only backends whose unsupported_reasons accept
        attn_logit_softcapping get one); ``alibi_slopes`` (fp32 [Hq] on the device, one
        tensor for the model's life: CUDA graphs keep its address): query head h's score of
        key position j from query position i gains alibi_slopes[h] * (j - i) after the
        scale and softcap (ALiBi, kernels/alibi.py; only backends whose unsupported_reasons
        accept ModelConfig.alibi get one); ``sinks`` (fp32 [Hq] on the device, the calling
        layer's own, a parameter: CUDA graphs keep its address): query head h's softmax
        denominator gains exp(sinks[h]), a logit with no value (GPT-OSS's attention sinks,
        kernels/sinks.py; only backends whose unsupported_reasons accept
        ModelConfig.attention_sinks get one); ``chunk_size``: chunked local attention (Llama 4's
        chunked_attention layers): a query at p sees keys j <= p with j // chunk_size ==
        p // chunk_size (only backends whose unsupported_reasons accept
        ModelConfig.attention_chunk_size get one)."""
