"""Adapters in slots: which adapter each of ``max_loras`` slots holds, loading on demand.

The engine owns one ``LoRAManager`` when started with ``enable_lora``:

- at construction every linear the model names in ``lora_targets()`` (HF module path ->
  our linear, output row offset, rows) gets a ``LoRALinear`` of ``max_loras`` zeroed slots;
  q/k/v_proj share qkv_proj's (three slices), gate/up_proj gate_up_proj's (two);
- ``add`` (at add_request) reads and checks an adapter once per ``lora_int_id`` and keeps
  it on the host (the ones live requests use, and a few more by LRU);
- ``activate`` (each step, after scheduling) puts the step's adapters in slots: one
  already there is kept, else a free slot or the least recently used one that no running
  request holds is overwritten (a device copy, ordered after the steps still in flight);
- ``slot_index`` then maps each adapter id to its slot for the model runner's per-token map.

The scheduler never lets more distinct adapters run than there are slots (Scheduler
``max_loras``), so ``activate`` always finds room.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flashpage.lora.adapter import LoRAAdapter, TargetShape, load_adapter
from flashpage.lora.layers import LoRALinear, LoRAState
from flashpage.lora.request import LoRARequest

logger = logging.getLogger("flashpage")

MIN_CPU_LORAS = 8  # adapters kept on the host beyond the live ones (by LRU)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_tokens: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        targets_of = getattr(model, "lora_targets", None)
        if targets_of is None:
            raise ValueError(f"enable_lora: LoRA adapters are not supported for "
                             f"{type(model).__name__} (every dense family and Mixtral / Qwen "
                             "MoE take them; DeepSeek's MLA layers do not)")
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and "
                             f"{max_lora_rank}")
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        # lora_B rows in our linear's order (a fused q/k/v regrouped at load: NeoX, Falcon,
        # Bloom, BigCode); the identity for most
        self._b_to_ours: Callable[[str, torch.Tensor], torch.Tensor] = getattr(
            model, "lora_b_to_ours", lambda module, b: b)
        self.state = LoRAState(max_tokens, device)
        spec: dict[str, tuple[str, int, int]] = targets_of()
        modules = dict(model.named_modules())
        groups: dict[str, list[tuple[int, int, str]]] = {}
        for hf, (ours, off, rows) in spec.items():
            groups.setdefault(ours, []).append((off, rows, hf))
        self.targets: dict[str, TargetShape] = {}
        self._where: dict[str, tuple[LoRALinear, int]] = {}  # HF path -> (slots, slice)
        self.layers: list[LoRALinear] = []
        for ours, pieces in groups.items():
            linear = modules[ours]
            out_f, in_f = linear.out_features, linear.in_features  # type: ignore[union-attr]
            pieces.sort()
            lora = LoRALinear(self.state, int(in_f), int(out_f), [(o, r) for o, r, _ in pieces],
                              max_loras, max_lora_rank, device, dtype)
            linear.lora = lora
            self.layers.append(lora)
            for j, (_, rows, hf) in enumerate(pieces):
                self.targets[hf] = TargetShape(int(in_f), rows)
                self._where[hf] = (lora, j)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host copies, LRU order
        self.slots: list[int | None] = [None] * max_loras  # adapter id per slot
        self.slot_index: dict[int, int] = {}  # adapter id -> slot
        self._last_used = [0] * max_loras
        self._tick = 0
        self.num_loads = 0  # adapters copied into a slot (stats, tests)
        nbytes = sum(t.a.numel() * t.a.element_size() + t.b.numel() * t.b.element_size()
                     for t in self.layers)
        logger.info("LoRA: %d linears, %d slots of rank <= %d (%.1f MiB)", len(self.layers),
                    max_loras, max_lora_rank, nbytes / 2**20)

    # ------------------------------------------------------------------ host side
    def add(self, req: LoRARequest, live_ids: Callable[[], set[int]]) -> LoRAAdapter:
        """The checked adapter of ``req`` (read from its folder the first time its id is
        seen); a ValueError names what is wrong with it. ``live_ids()``: the adapter ids
        unfinished requests hold, which stay on the host."""
        known = self.adapters.get(req.lora_int_id)
        if known is not None:
            if known.request.lora_path != req.lora_path:
                raise ValueError(
                    f"lora_int_id {req.lora_int_id} already names adapter {known.request.lora_name!r} "
                    f"at {known.request.lora_path}, not {req.lora_path}: give each adapter its own id")
            self.adapters.move_to_end(req.lora_int_id)
            return known
        adapter = load_adapter(req, self.targets, self.max_rank)
        adapter.modules = {hf: (a, self._b_to_ours(hf, b)) for hf, (a, b) in adapter.modules.items()}
        # Not held by any request (it would be on the host): a slot may hold an older copy.
        slot = self.slot_index.pop(req.lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
        self.adapters[req.lora_int_id] = adapter
        if len(self.adapters) > max(MIN_CPU_LORAS, 2 * self.max_loras):
            live = live_ids() | {req.lora_int_id}
            for old in [i for i in self.adapters if i not in live]:
                if len(self.adapters) <= max(MIN_CPU_LORAS, 2 * self.max_loras):
                    break
                del self.adapters[old]
        logger.info("LoRA adapter %r (id %d) loaded: rank %d, %d modules, %.1f MiB", req.lora_name,
                    req.lora_int_id, adapter.rank, len(adapter.modules), adapter.num_bytes / 2**20)
        return adapter

    def remove(self, lora_int_id: int, live_ids: set[int]) -> bool:
        """Forget an adapter (vLLM's remove_lora): its host copy and its slot, unless a
        request still running holds it (that request keeps it until it ends; the next
        ``add`` with this id reads the folder again). False if it was not loaded."""
        if lora_int_id not in self.adapters and lora_int_id not in self.slot_index:
            return False
        if lora_int_id in live_ids:
            return True
        self.adapters.pop(lora_int_id, None)
        slot = self.slot_index.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
        return True

    # ------------------------------------------------------------------ slots
    def activate(self, ids: Iterable[int], pinned: set[int]) -> dict[int, int]:
        """Put every adapter in ``ids`` (a step's) in a slot; slots of adapters in
        ``pinned`` (running requests') are never taken. Returns ``slot_index``."""
        self._tick += 1
        want = dict.fromkeys(i for i in ids if i)
        for lid in want:
            slot = self.slot_index.get(lid)
            if slot is None:
                slot = self._free_slot(set(want) | pinned)
                self._load(slot, lid)
            self._last_used[slot] = self._tick
        return self.slot_index

    def _free_slot(self, keep: set[int]) -> int:
        empty = [s for s, lid in enumerate(self.slots) if lid is None]
        if empty:
            return empty[0]
        free = [s for s, lid in enumerate(self.slots) if lid not in keep]
        if not free:
            raise RuntimeError(f"no LoRA slot free for the step: all {self.max_loras} hold adapters "
                               "of running requests (the scheduler admits at most max_loras)")
        return min(free, key=lambda s: self._last_used[s])

    def _load(self, slot: int, lid: int) -> None:
        adapter = self.adapters.get(lid)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter id {lid} is not loaded (add_request loads it)")
        old = self.slots[slot]
        if old is not None:
            del self.slot_index[old]
        pieces: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {
            id(t): {} for t in self.layers}
        for hf, ab in adapter.modules.items():
            lora, j = self._where[hf]
            pieces[id(lora)][j] = ab
        for t in self.layers:
            t.set_slot(slot, pieces[id(t)])
        self.slots[slot] = lid
        self.slot_index[lid] = slot
        self.num_loads += 1

    def stats(self) -> dict[str, Any]:
        return {"slots": list(self.slots), "loaded_on_host": list(self.adapters),
                "slot_loads": self.num_loads}
