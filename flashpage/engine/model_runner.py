"""Owns the model and its KV cache tensors; turns a SchedulerOutput into one forward pass.

Each step builds one flat ragged batch (no padding): the new tokens of every scheduled
request back to back, decodes first, with positions, slot mapping, block tables and
query start offsets (see AttentionMetadata). Logits are computed only for the last
scheduled token of requests that reach the end of their known tokens this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flashpage.attention.backend import AttentionBackend, AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.engine.sampler import Sampler, SamplerOutput
from flashpage.engine.scheduler import SchedulerOutput
from flashpage.engine.sequence import Request
from flashpage.kv_cache.kv_cache_manager import KVCacheManager


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, backend: AttentionBackend,
                 kv_manager: KVCacheManager, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.config = model_config
        self.backend = backend
        self.kv_manager = kv_manager
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(model_config.vocab_size)
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        self.pin = device.type == "cuda"

    # ------------------------------------------------------------------ cache
    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers = self.model.attention_layers()  # type: ignore[operator]
        caches = []
        for layer in layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            kc = torch.zeros(shape, dtype=self.dtype, device=self.device)
            vc = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.kv_cache = (kc, vc)
            layer.backend = self.backend
            caches.append((kc, vc))
        return caches

    # ------------------------------------------------------------------ inputs
    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        # Decodes (one new token) first; the kernels dispatch on that split.
        sched = sorted(out.scheduled, key=lambda rn: rn[1] != 1)
        num_seqs = len(sched)
        total = sum(n for _, n in sched)
        bs = self.block_size
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total, dtype=np.int64)
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        tables = []
        logits_idx: list[int] = []
        sample_reqs: list[Request] = []
        num_decodes = 0
        t = 0
        for i, (req, n) in enumerate(sched):
            start = req.num_computed_tokens
            end = start + n
            input_ids[t:t + n] = req.all_token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            positions[t:t + n] = pos
            block_ids = self.kv_manager.get_block_ids(req.request_id)
            table = np.asarray(block_ids, dtype=np.int64)
            slot_mapping[t:t + n] = table[pos // bs] * bs + pos % bs
            tables.append(block_ids)
            seq_lens[i] = end
            t += n
            qsl[i + 1] = t
            if n == 1 and num_decodes == i:
                num_decodes += 1
            if end == req.num_tokens:
                logits_idx.append(t - 1)
                sample_reqs.append(req)
        max_blocks = max((len(b) for b in tables), default=1)
        block_tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)
        for i, b in enumerate(tables):
            block_tables[i, : len(b)] = b
        qlens = np.diff(qsl)
        md = AttentionMetadata(
            num_actual_tokens=total,
            num_seqs=num_seqs,
            query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(seq_lens),
            block_tables=self._to_device(block_tables),
            slot_mapping=self._to_device(slot_mapping),
            max_query_len=int(qlens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_lens_cpu=qlens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        md = self.backend.prepare(md)
        return StepInputs(self._to_device(input_ids), self._to_device(positions), md,
                          self._to_device(np.asarray(logits_idx, dtype=np.int64)), sample_reqs)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that got a token and the sampler's output."""
        if not out.scheduled:
            return [], None
        inp = self.prepare(out)
        hidden = self.model(inp.input_ids, inp.positions, inp.metadata)
        if not inp.sample_requests:
            return [], None
        logits = self.model.compute_logits(hidden[inp.logits_indices])  # type: ignore[operator]
        return inp.sample_requests, self.sampler(logits, inp.sample_requests)
