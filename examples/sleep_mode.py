"""Sleep mode and in-place weight updates, the loop an RLHF trainer (verl, OpenRLHF) runs
around vLLM: generate, sleep while the trainer steps, wake the weights, load the trainer's
tensors, wake the KV cache, generate with the new weights.

    python examples/sleep_mode.py MODEL_FOLDER [UPDATED_FOLDER]

MODEL_FOLDER: an HF checkpoint (safetensors); UPDATED_FOLDER: another of the same shapes
(say, a fine-tune of it), standing in for the trainer's tensors. Without it the first
checkpoint's own tensors are loaded back.
"""

import sys

import torch

from flashpage import LLM, SamplingParams
from flashpage.models.loader import iter_safetensors

model = sys.argv[1]
updated = sys.argv[2] if len(sys.argv) > 2 else model
llm = LLM(model, enable_sleep_mode=True)
params = SamplingParams(temperature=0.0, max_tokens=32)
prompt = "The capital of France is"
print("before:", llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text)

cuda = torch.cuda.is_available() and llm.engine.device.type == "cuda"
used = torch.cuda.memory_allocated() if cuda else 0
llm.sleep(level=2)  # weights discarded, KV cache freed: the trainer has the GPU
if cuda:
    print(f"asleep: {(used - torch.cuda.memory_allocated()) / 2**30:.2f} GiB given back")

llm.wake_up(tags=["weights"])  # room for the weights only (no KV cache yet)
llm.load_weights(iter_safetensors(updated))  # HF names; q/k/v, gate/up merged by the loader
llm.wake_up(tags=["kv_cache"])
print("after: ", llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text)
