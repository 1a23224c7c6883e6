"""LoRA adapters (PEFT format) served beside the base model, vLLM's way: ``LLM(model,
enable_lora=True, max_loras=N, max_lora_rank=R)`` and ``lora_request=LoRARequest(...)``.

request.py  LoRARequest (no torch: the server and the API import it cheaply)
adapter.py  read and check a PEFT adapter folder against the model's targets
layers.py   the per-linear slot weights and the batched delta every step adds
manager.py  slots, loading on demand, LRU eviction, each step's token -> slot map
"""

from __future__ import annotations

from flashpage.lora.request import LoRARequest

__all__ = ["LoRARequest"]
