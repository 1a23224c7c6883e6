"""Owns the model and its KV cache tensors; turns a SchedulerOutput into one forward pass.

Each step builds one flat ragged batch (no padding): the new tokens of every scheduled
request back to back, decodes first, with positions, slot mapping, block tables and
query start offsets (see AttentionMetadata). Logits are computed only for the last
scheduled token of requests that reach the end of their known tokens this step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from flashpage.attention.backend import AttentionBackend, AttentionMetadata, with_groups
from flashpage.config import ModelConfig
from flashpage.engine.cuda_graph import DecodeGraphs, PiecewiseGraphs, PrefillGraphs
from flashpage.engine.encoder_cache import EncoderCache
from flashpage.engine.mrope import step_positions
from flashpage.engine.multimodal import (
    MultiModalEncoder,
    bidirectional_runs,
    encode_pending,
    overlapping,
    step_rows,
)
from flashpage.engine.sampler import PendingSample, Sampler
from flashpage.engine.scheduler import SchedulerOutput
from flashpage.engine.sequence import PLACEHOLDER, Request
from flashpage.engine.spec_decode import guide_states, verify_drafts
from flashpage.kv_cache.hybrid import GroupLayout, HybridKVCacheManager
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from flashpage.lora.manager import LoRAManager
from flashpage.models.common import InputEmbeds
from flashpage.pooling import PooledBatch, PoolingState

TABLE_WIDTH_MULTIPLE = 16
PROMPT_LOGPROB_ROWS = 512  # prompt_logprobs: logits rows computed at once (512 x 128k fp32: 256 MB)


def _table_width(blocks: int) -> int:
    """A step's block-table width: its longest row rounded up to a multiple of 16. The width
    is the tables' row stride, and Triton/Gluon kernels specialize on an integer argument
    being 1 or a multiple of 16: a width that followed the longest row would compile the
    decode kernels again inside users' requests, after the warm-up (run 84: two compiles,
    1.1-1.2 s steps), and a kernel told the stride is not a multiple of 16 loses the
    alignment of its table rows."""
    return -(-max(blocks, 1) // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]
    # prompt_logprobs: (request, its first row in the step, its first position, rows) for
    # the rows whose next token is a prompt token
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # embeddings: (request, its first row in the step, its first position, prompt rows)
    pool_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # speculative decoding: (request, its drafts) in the order of their logits rows, which
    # follow the sampled requests' rows in logits_indices (engine/spec_decode.py)
    spec: list[tuple[Request, list[int]]] = field(default_factory=list)
    # prompts given as embeddings (engine/prompt_embeds.py): their rows of this step
    inputs_embeds: InputEmbeds | None = None


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, backend: AttentionBackend,
                 kv_manager: KVCacheManager | HybridKVCacheManager, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                 layout: GroupLayout | None = None,
                 kv_memory: Callable[[], AbstractContextManager] | None = None) -> None:
        self.model = model
        self.config = model_config
        self.backend = backend
        self.kv_manager = kv_manager
        # KV cache groups (kv_cache/hybrid.py): each attention layer's group and slot
        self.layout = layout
        self.num_groups = layout.num_groups if layout is not None else 1
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the paged K/V (or MLA latent) cache's
        self.sampler = Sampler(model_config.vocab_size)
        backend.bind_kv_cache(num_blocks, block_size)
        # the K/V tensors in sleep mode's fixed-address memory (engine/cumem.py) when given
        with (kv_memory or nullcontext)():
            self.kv_caches = self._allocate_kv_cache(num_blocks)
        self.pin = device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self._rows: dict[tuple[str, int], np.ndarray] = {}
        # The last launched step's sampled tokens (on the device) and each request's row
        # in them: a next step's input that is still a PLACEHOLDER is read from there.
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # LoRA (flashpage/lora/): each step writes its tokens' adapter slots into
        # lora.state.token_slots, which every LoRA linear (and graph) reads
        self.lora: LoRAManager | None = None
        # An MTP draft (engine/mtp.py) reads the last step's final hidden states (the
        # model's DecoderStack.hidden_out, in the step's token order): with keep_layout, each
        # step's (request, first token row, first position, tokens), in that order.
        self.keep_layout = False
        self.last_layout: list[tuple[Request, int, int, int]] = []
        # the encoder of a model's multimodal rows (engine/multimodal.py; LLaVA's images)
        self.mm_encoder: MultiModalEncoder | None = None
        # the most rows one encoder call takes (a step's images in batches of this many)
        self.mm_encode_rows: int | None = None
        # encoder outputs kept for later requests of the same inputs (engine/encoder_cache.py)
        self.encoder_cache: EncoderCache | None = None

    def capture_decode_graphs(self, max_bs: int, max_model_len: int) -> None:
        """Capture decode-step CUDA graphs (needs a backend without host syncs)."""
        max_blocks = _table_width(-(-max_model_len // self.block_size))
        self.graphs = DecodeGraphs(self.model, max_bs, max_blocks, self.device, groups=self.num_groups)
        self.graphs.capture()

    def capture_prefill_graphs(self, max_tokens: int, max_model_len: int, *, capture: bool = True,
                               rows_per_seq: int = 1) -> None:
        """Graphs for prompt-only steps of up to 4 requests and ``max_tokens`` (<= 1024)
        tokens, in the decode graphs' pool (cuda_graph.PrefillGraphs; needs a backend whose
        prompt path has no host syncs). ``capture=False``: the same padded steps, run
        eagerly (tests on the CPU)."""
        max_blocks = _table_width(-(-max_model_len // self.block_size))
        self.prefill_graphs = PrefillGraphs(self.model, self.backend.prepare, max_tokens,
                                            max_blocks, self.block_size, self.device,
                                            rows_per_seq=rows_per_seq, groups=self.num_groups)
        if capture:
            self.prefill_graphs.capture(self.graphs.pool if self.graphs is not None else None)

    def capture_piecewise_graphs(self, max_tokens: int, *, capture: bool = True) -> None:
        """Piecewise graphs (all but attention) for the other steps of up to ``max_tokens``
        (<= 1024) tokens, in the decode graphs' pool (cuda_graph.PiecewiseGraphs).
        ``capture=False``: the same padded steps, run eagerly (tests on the CPU)."""
        self.piecewise = PiecewiseGraphs(self.model, max_tokens, self.device, self.num_groups)
        if capture:
            pool = self.prefill_graphs.pool if self.prefill_graphs is not None else None
            if pool is None and self.graphs is not None:
                pool = self.graphs.pool
            self.piecewise.capture(pool)

    # ------------------------------------------------------------------ cache
    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor] | torch.Tensor]:
        layers = self.model.attention_layers()  # type: ignore[operator]
        caches: list[tuple[torch.Tensor, torch.Tensor] | torch.Tensor] = []
        if self.layout is not None:  # one pair per slot: a block id is memory in each slot
            lay = self.layout
            if len(layers) != len(lay.layer_group):
                raise ValueError(f"KV cache groups for {len(lay.layer_group)} layers, the model "
                                 f"has {len(layers)} attention layers")
            pairs = []
            for _ in range(lay.num_slots):
                shape = (num_blocks, self.block_size, layers[0].num_kv_heads, layers[0].head_dim)
                pairs.append((torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                              torch.zeros(shape, dtype=self.kv_dtype, device=self.device)))
            for i, layer in enumerate(layers):
                g = lay.layer_group[i]
                span = (layer.sliding_window, getattr(layer, "chunk_size", None))
                if span != (lay.windows[g], lay.chunk(g)) or \
                        (layer.num_kv_heads, layer.head_dim) != (layers[0].num_kv_heads, layers[0].head_dim):
                    raise ValueError(f"attention layer {i} (window, chunk {span}) does not fit KV "
                                     f"cache group {g} (window, chunk {lay.windows[g], lay.chunk(g)})")
                layer.kv_cache, layer.kv_group = pairs[lay.layer_slot[i]], g
                layer.backend = self.backend
            return list(pairs)
        for layer in layers:
            if getattr(layer, "is_mla", False):  # MLA: one latent tensor per layer
                latent = torch.zeros(layer.kv_cache_shape(num_blocks, self.block_size),
                                     dtype=self.kv_dtype, device=self.device)
                layer.kv_cache = latent
                layer.backend = self.backend
                caches.append(latent)
                continue
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            kc = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            vc = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
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

    def _table_rows(self, reqs: list[Request], group: int = 0) -> list[np.ndarray]:
        """Each request's block table (of a KV cache group) as int32, cached: blocks are only
        ever appended, or their leading entries released (sliding window: pointed at the
        null block). One group's manager read directly (a hybrid cache's 7 groups at 256
        requests: ~1,800 rows a step)."""
        kv = self.kv_manager
        mgr = kv.groups[group] if isinstance(kv, HybridKVCacheManager) else kv
        block_ids, num_released, cache = mgr.get_block_ids, mgr.num_released, self._rows
        out = []
        for req in reqs:
            rid = req.request_id
            ids, released = block_ids(rid), num_released(rid)
            row = cache.get((rid, group))
            if (row is None or len(row) != len(ids) or (len(ids) and row[0] != ids[0])
                    or (released and row[released - 1] != ids[released - 1])):
                row = np.fromiter(ids, dtype=np.int32, count=len(ids))
                cache[rid, group] = row
            out.append(row)
        return out

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        for rid in (*out.finished_request_ids, *out.preempted_request_ids):
            for g in range(self.num_groups):
                self._rows.pop((rid, g), None)
        # Decodes (one new token) first; the kernels dispatch on that split. Decodes longest
        # context first: the decode kernel's grid then starts the longest programs first
        # (longest-processing-time order), so a ragged batch does not end on a few long
        # ones running alone (8B shape, fp8 cache, 128 requests of 101-2048 tokens: 1.15x
        # the given order; bf16 1.25x; attention_decode.py --engine-shapes, run 61).
        sched = sorted(out.scheduled, key=lambda rn: (rn[1] != 1, -rn[0].num_computed_tokens if rn[1] == 1 else 0))
        num_seqs = len(sched)
        total = out.total_num_scheduled_tokens
        bs = self.block_size
        # One int64 staging array -> one host-to-device copy per step:
        # [input_ids | positions | slot_mapping | qsl | seq_lens | logits_idx | block_tables
        #  | pending decodes' rows | LoRA slot of each token | each other KV cache group's
        #  slot mapping and block tables]
        reqs_in_order = [r for r, _ in sched]
        rows = self._table_rows(reqs_in_order)
        width = _table_width(max((len(r) for r in rows), default=1))
        # Requests whose range reaches their last known token get a logits row there; those
        # with drafts after it (speculative decoding) one more per draft, after all the others.
        n_sample = sum(1 for r, n in sched if r.num_computed_tokens + n >= r.num_tokens)
        n_drafts = sum(max(r.num_computed_tokens + n - r.num_tokens, 0) for r, n in sched)
        n_logits = n_sample + n_drafts
        # Decodes whose input token is still being sampled by the previous step.
        pending = [i for i, (r, n) in enumerate(sched)
                   if n == 1 and r.all_token_ids[r.num_computed_tokens] == PLACEHOLDER]
        n_pend = len(pending)
        lora = self.lora
        extra = self.num_groups - 1  # the other KV cache groups' slot mappings and tables
        sizes = [total, total, total, num_seqs + 1, num_seqs, n_logits, num_seqs * width,
                 n_pend, n_pend, total if lora is not None else 0,
                 *[total, num_seqs * width] * extra]
        offs = np.cumsum([0, *sizes])
        buf = np.zeros(int(offs[-1]), dtype=np.int64)
        input_ids, positions, slot_mapping, qsl, seq_lens, logits_idx, tables, pend_dst, \
            pend_src, lora_slots = (buf[offs[i]:offs[i + 1]] for i in range(10))
        tables2d = tables.reshape(num_seqs, width)
        # group g >= 1: (its rows, its slot mapping, its tables) in the staging buffer
        others = [(self._table_rows(reqs_in_order, g), buf[offs[8 + 2 * g]:offs[9 + 2 * g]],
                   buf[offs[9 + 2 * g]:offs[10 + 2 * g]].reshape(num_seqs, width))
                  for g in range(1, extra + 1)]
        sample_reqs: list[Request] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []
        pool_rows: list[tuple[Request, int, int, int]] = []
        spec: list[tuple[Request, list[int]]] = []
        layout: list[tuple[Request, int, int, int]] = []
        embeds: list[tuple[int, torch.Tensor]] = []  # (first row, rows) of embeds prompts
        deep: list[tuple[int, torch.Tensor]] = []  # (first row, [m, k, H]) Qwen3-VL's deepstack
        three: list[tuple[int, np.ndarray]] = []  # (first row, [3, n]) of M-RoPE 3-D positions
        both_ways: list[tuple[int, int, int, int, int, int]] = []  # AttentionMetadata.bidirectional
        if self.mm_encoder is not None:  # this step's inputs not encoded yet, in one batch
            todo = [mi for r, n in sched if r.mm_inputs
                    for mi in overlapping(r.mm_inputs, r.num_computed_tokens, r.num_computed_tokens + n)
                    if mi.rows is None]
            encode_pending(self.mm_encoder, list(dict.fromkeys(todo)),  # n > 1: shared inputs
                           self.mm_encode_rows, self.encoder_cache)
        num_decodes = 0
        t = 0
        k = 0
        d = n_sample  # the next draft-checking row in logits_idx
        for i, (req, n) in enumerate(sched):
            start = req.num_computed_tokens
            end = start + n
            row = rows[i]
            tables2d[i, : len(row)] = row
            if others:
                if n == 1:  # a decode: its slot in each group by scalar arithmetic
                    blk, off = start // bs, start % bs
                    for g_rows, g_slots, g_tables in others:
                        g_row = g_rows[i]
                        g_tables[i, : len(g_row)] = g_row
                        g_slots[t] = int(g_row[blk]) * bs + off
                else:
                    pos = np.arange(start, end, dtype=np.int64)
                    blk_idx, offs_in = pos // bs, pos % bs
                    for g_rows, g_slots, g_tables in others:
                        g_row = g_rows[i]
                        g_tables[i, : len(g_row)] = g_row
                        g_slots[t:t + n] = g_row[blk_idx].astype(np.int64) * bs + offs_in
            if n == 1:
                input_ids[t] = req.all_token_ids[start]
                if req.mrope_positions is None:
                    positions[t] = start
                else:  # M-RoPE (engine/mrope.py): shifted (a decode), or an image's row
                    one, pos3 = step_positions(req.mrope_positions, req.mrope_delta, start, end)
                    positions[t] = one[0]
                    if pos3 is not None:
                        three.append((t, pos3))
                slot_mapping[t] = int(row[start // bs]) * bs + start % bs
                if num_decodes == i:
                    num_decodes += 1
            else:
                drafted = end - req.num_tokens
                if drafted > 0:  # its last token, then its drafts
                    drafts = req.spec_token_ids[:drafted]
                    input_ids[t:t + n - drafted] = req.all_token_ids[start:]
                    input_ids[t + n - drafted:t + n] = drafts
                    # the rows at its last token and at every draft but the last check the
                    # drafts; the last draft's row is its sampled row, as any request's
                    first = t + n - drafted - 1
                    logits_idx[d:d + drafted] = np.arange(first, first + drafted)
                    d += drafted
                    spec.append((req, drafts))
                else:
                    input_ids[t:t + n] = req.all_token_ids[start:end]
                pos = np.arange(start, end, dtype=np.int64)
                if req.mrope_positions is None:
                    positions[t:t + n] = pos
                else:  # M-RoPE (engine/mrope.py): shifted, or 3-D over an image's rows
                    positions[t:t + n], pos3 = step_positions(req.mrope_positions, req.mrope_delta,
                                                              start, end)
                    if pos3 is not None:
                        three.append((t, pos3))
                slot_mapping[t:t + n] = row[pos // bs].astype(np.int64) * bs + pos % bs
            seq_lens[i] = end
            if lora is not None:
                lora_slots[t:t + n] = lora.slot_index[req.lora_int_id] if req.lora_int_id else -1
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # rows at positions start .. predict prompt tokens start + 1 ..
                prompt_rows.append((req, t, start, min(end, req.num_prompt_tokens - 1) - start))
            if req.prompt_embeds is not None and start < req.num_prompt_tokens:
                # its input_ids there are placeholders; the model reads these rows instead
                embeds.append((t, req.prompt_embeds[start:min(end, req.num_prompt_tokens)]))
            if req.mm_inputs and start < req.num_prompt_tokens:  # engine/multimodal.py
                embeds += [(t + i, rows) for i, rows in step_rows(req.mm_inputs, start, end)]
                deep += [(t + i, f) for i, f in step_rows(req.mm_inputs, start, end, deepstack=True)]
                both_ways += [(i, t + p - start, k, p, lo, hi)
                              for p, k, lo, hi in bidirectional_runs(req.mm_inputs, start, end)]
            if req.pooling is not None and start < req.num_prompt_tokens:
                pool_rows.append((req, t, start, min(end, req.num_prompt_tokens) - start))
            if self.keep_layout:
                layout.append((req, t, start, n))
            t += n
            qsl[i + 1] = t
            if end >= req.num_tokens:
                logits_idx[k] = t - 1
                k += 1
                sample_reqs.append(req)
        self.last_layout = layout
        for j, i in enumerate(pending):  # decodes come first: token index == row
            pend_dst[j] = i
            pend_src[j] = self._prev_rows[sched[i][0].request_id]
        dev = self._to_device(buf)
        d_input_ids, d_positions, d_slots, d_qsl, d_seq_lens, d_logits, d_tables, d_dst, \
            d_src, d_lora = (dev[offs[i]:offs[i + 1]] for i in range(10))
        if lora is not None:
            # in stream order after the step in flight (async scheduling) has read it
            lora.state.token_slots[:total].copy_(d_lora)
            lora.state.token_slots[total:].fill_(-1)
        if n_pend:
            assert self._prev_tokens is not None
            d_input_ids[d_dst] = self._prev_tokens[d_src]
        if three:  # the step's positions as [3, total] (text rows: three equal components)
            pos3d = np.repeat(positions[None, :], 3, axis=0)
            for t0, p3 in three:
                pos3d[:, t0:t0 + p3.shape[1]] = p3
            d_positions = self._to_device(pos3d)
        qlens = np.diff(qsl)
        md = AttentionMetadata(
            num_actual_tokens=total,
            num_seqs=num_seqs,
            query_start_loc=d_qsl.to(torch.int32),
            seq_lens=d_seq_lens.to(torch.int32),
            block_tables=d_tables.view(num_seqs, width).to(torch.int32),
            slot_mapping=d_slots,
            max_query_len=int(qlens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_lens_cpu=qlens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            bidirectional=both_ways,
        )
        md = with_groups(self.backend.prepare(md), [
            (dev[offs[9 + 2 * g]:offs[10 + 2 * g]].view(num_seqs, width).to(torch.int32),
             dev[offs[8 + 2 * g]:offs[9 + 2 * g]]) for g in range(1, extra + 1)], self.backend.prepare)
        return StepInputs(d_input_ids, d_positions, md, d_logits, sample_reqs, prompt_rows, pool_rows,
                          spec, self._inputs_embeds(embeds, deep))

    def _inputs_embeds(self, parts: list[tuple[int, torch.Tensor]],
                       deep: list[tuple[int, torch.Tensor]] | None = None) -> InputEmbeds | None:
        """The step's rows given as embeddings: (first row, [m, width] host rows) each ->
        their rows and values on the device (one copy each, pinned on CUDA); ``deep``:
        (first row, [m, k, width] device features) of Qwen3-VL's image rows (deepstack)."""
        if not parts:
            return None
        if deep:
            out = self._inputs_embeds(parts)
            assert out is not None
            out.deep_rows = torch.cat([torch.arange(t, t + len(v), dtype=torch.int64) for t, v in deep]
                                      ).to(self.device)
            out.deep_values = torch.cat([v.to(self.device) for _, v in deep]) if len(deep) > 1 else deep[0][1]
            return out
        rows = torch.cat([torch.arange(t, t + len(v), dtype=torch.int64) for t, v in parts])
        # host rows (prompt embeds) pinned for their copy; device rows (multimodal) as they are
        vals = [v.pin_memory() if self.pin and v.device.type == "cpu" else v for _, v in parts]
        values = torch.cat([v.to(self.device, non_blocking=True) for v in vals]) \
            if len(vals) > 1 else vals[0].to(self.device, non_blocking=True)
        if self.pin:
            return InputEmbeds(rows.pin_memory().to(self.device, non_blocking=True), values)
        return InputEmbeds(rows.to(self.device), values)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list[tuple[Request, int, int, int]]) -> None:
        """Each prompt_rows row's logprobs of the prompt token after it (raw log_softmax, its
        rank, the top prompt_logprobs alternatives), appended to its request's
        ``prompt_logprobs`` (a position already there, from before a preemption, is kept).
        Waits for the device: prompt logprobs are for evaluation, not for speed."""
        from flashpage.engine.sampler import Logprobs

        rows = torch.cat([torch.arange(t, t + k) for _, t, _, k in prompt_rows])
        targets = torch.tensor([tok for r, _, p, k in prompt_rows
                                for tok in r.all_token_ids[p + 1: p + 1 + k]])
        kmax = max(r.sampling_params.prompt_logprobs or 0 for r, *_ in prompt_rows)
        chosen_l: list[float] = []
        ranks: list[int] = []
        top_vl: list[list[float]] = []
        top_il: list[list[int]] = []
        # In chunks of rows: a whole 8k-token chunk's fp32 logits over a 128k vocabulary
        # would be 4 GB (and as much again for their log_softmax).
        for c in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            sub, tgt = rows[c: c + PROMPT_LOGPROB_ROWS], targets[c: c + PROMPT_LOGPROB_ROWS]
            logits = self.model.compute_logits(hidden[sub.to(hidden.device)])  # type: ignore[operator]
            lp = torch.log_softmax(logits[:, : self.config.vocab_size].float(), dim=-1)
            chosen = lp.gather(1, tgt.to(lp.device)[:, None])
            ranks += ((lp > chosen).sum(1) + 1).tolist()
            chosen_l += chosen[:, 0].tolist()
            if kmax:
                top_v, top_i = lp.topk(kmax, dim=-1)
                top_vl += top_v.tolist()
                top_il += top_i.tolist()
        j = 0
        for req, _, pos, k in prompt_rows:
            want = req.sampling_params.prompt_logprobs or 0
            plp = req.prompt_logprobs
            assert plp is not None
            for p in range(pos, pos + k):
                if len(plp) == p + 1:  # token p + 1's entry
                    top = list(zip(top_il[j][:want], top_vl[j][:want], strict=True)) \
                        if want and top_il and top_vl else []
                    plp.append(Logprobs(int(targets[j]), chosen_l[j], ranks[j], top))
                j += 1

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], PendingSample | None]:
        """Launch one step without waiting for the device; returns the requests that get
        a token and their pending sample (``result()`` reads the tokens back)."""
        reqs, pending = self._execute(out)
        if pending is not None:
            self._prev_tokens = pending.tokens
            self._prev_rows = {r.request_id: i for i, r in enumerate(reqs)}
        return reqs, pending

    def _execute(self, out: SchedulerOutput) -> tuple[list[Request], PendingSample | None]:
        if not out.scheduled:
            self.last_layout = []
            return [], None
        inp = self.prepare(out)
        md = inp.metadata
        # Steps whose hidden states are read (prompt logprobs, embeddings) skip the graphs
        # that hand back only the sampled rows' logits; steps that check drafts (more rows
        # than requests) the decode graphs, and the prompt-step ones unless they have the rows.
        reads_hidden = bool(inp.prompt_rows or inp.pool_rows)
        # rows given as embeddings run eagerly: the graphs' static inputs are token ids only
        # (and 1-D positions: a step with M-RoPE's 3-D ones, an image's rows, is eager too)
        eager = inp.inputs_embeds is not None or inp.positions.dim() == 2
        if (self.graphs is not None and not eager and md.num_decodes == md.num_seqs and not reads_hidden
                and not inp.spec
                and self.graphs.bucket(md.num_seqs) is not None):
            # One token per request, each sampled: token index == row of the captured
            # logits == logits index, so the rows are used in place (no gather of
            # [batch, vocab] per step; the next replay rewrites them after sampling).
            assert len(inp.sample_requests) == md.num_seqs
            logits = self.graphs.run(inp.input_ids, inp.positions, md, md.num_seqs)
        elif (self.prefill_graphs is not None and not eager and md.num_decodes == 0 and not reads_hidden
                and (key := self.prefill_graphs.key(md.num_seqs, md.num_actual_tokens)) is not None
                and len(inp.logits_indices) <= self.prefill_graphs.rows(key)):
            # A short prompt-only step: its host time is its launches (cuda_graph.py).
            logits = self.prefill_graphs.run(inp.input_ids, inp.positions, md, inp.logits_indices)
        else:
            if (self.piecewise is not None and not eager
                    and self.piecewise.bucket(md.num_actual_tokens) is not None):
                # Mixed and many-prompt steps: all but the attention replayed (cuda_graph.py).
                hidden = self.piecewise.run(inp.input_ids, inp.positions, md)
            elif eager:
                hidden = self.model(inp.input_ids, inp.positions, md, inp.inputs_embeds)
            else:
                hidden = self.model(inp.input_ids, inp.positions, md)
            if inp.prompt_rows:
                self._prompt_logprobs(hidden, inp.prompt_rows)
            pooled: list[PoolingState] = []  # the prompts that end this step
            for req, t, start, n in inp.pool_rows:  # final-norm hidden states (flashpage/pooling.py)
                assert req.pooling is not None
                req.pooling.add(hidden[t:t + n], start, req.num_prompt_tokens)
                if start + n == req.num_prompt_tokens:
                    pooled.append(req.pooling)
            if not inp.sample_requests:
                return [], None
            logits = self.model.compute_logits(hidden[inp.logits_indices])  # type: ignore[operator]
            if pooled:  # their outputs as one batch, read back with the step's tokens
                reqs, pending = self._launch(inp, logits)
                assert pending is not None
                pending.pooled = PooledBatch(pooled)
                return reqs, pending
        return self._launch(inp, logits)

    def _launch(self, inp: StepInputs, logits: torch.Tensor) -> tuple[list[Request], PendingSample | None]:
        """Sample the step's tokens (and check its drafts) from its logits rows."""
        if not inp.sample_requests:
            return [], None
        if not inp.spec:
            return inp.sample_requests, self.sampler.launch(logits, inp.sample_requests)
        n = len(inp.sample_requests)
        states = guide_states(inp.spec)
        for req, _ in inp.spec:  # the sampled row follows the drafts: the pattern's state there
            if req.guide is not None:
                req.guide.lookahead = states[req.request_id][-1]
        try:
            pending = self.sampler.launch(logits[:n], inp.sample_requests)
        finally:
            for req, _ in inp.spec:
                if req.guide is not None:
                    req.guide.lookahead = None
        checked = verify_drafts(logits[n:], inp.spec, self.config.vocab_size, states)
        pending.drafted = {r.request_id: v for (r, _), v in zip(inp.spec, checked, strict=True)}
        return inp.sample_requests, pending
