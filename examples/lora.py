"""LoRA adapters (vLLM's enable_lora / LoRARequest): one engine serves the base model and
several PEFT adapters at once; each prompt names its adapter, or none.

    python examples/lora.py MODEL_FOLDER ADAPTER_FOLDER [ADAPTER_FOLDER ...]

MODEL_FOLDER: a Llama-family HF checkpoint; each ADAPTER_FOLDER a PEFT LoRA adapter trained
on it (adapter_config.json + adapter_model.safetensors).
"""

import sys

from flashpage import LLM, LoRARequest, SamplingParams

model, adapters = sys.argv[1], sys.argv[2:]
llm = LLM(model, enable_lora=True, max_loras=max(1, len(adapters)), max_lora_rank=64)
loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]
prompt = "Write a SQL query that counts the users who signed up in May."
params = SamplingParams(temperature=0.0, max_tokens=64)
# one batch: the base model and every adapter side by side
outs = llm.generate([prompt] * (1 + len(loras)), params, lora_request=[None, *loras])
for lora, out in zip([None, *loras], outs, strict=True):
    print(f"--- {lora.lora_name if lora else 'base model'}")
    print(out.error or out.outputs[0].text)
