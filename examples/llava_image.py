"""Image input with a LLaVA-1.5 checkpoint (vLLM's multimodal prompts), offline and served.

    python examples/llava_image.py path/to/llava-1.5-7b-hf photo.jpg

One <image> in the prompt per image (a list of images for several); the prompt format is
the checkpoint's ("USER: <image>\\n... ASSISTANT:" for llava-1.5). A LLaVA-NeXT checkpoint
(llava-v1.6) runs the same way with its own format ("[INST] <image>\\n... [/INST]" for
llava-v1.6-mistral-7b-hf); the chat API below applies the checkpoint's template for you.
"""

import base64
import sys

from PIL import Image

from flashpage import LLM, SamplingParams

model, path = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype="bfloat16")
image = Image.open(path)
out = llm.generate({"prompt": "USER: <image>\nWhat is in this picture? ASSISTANT:",
                    "multi_modal_data": {"image": image}},
                   SamplingParams(temperature=0, max_tokens=64))
print(out[0].outputs[0].text)

# Served: flashpage serve path/to/llava-1.5-7b-hf &  then (data URLs only: nothing is fetched)
with open(path, "rb") as f:
    url = "data:image/jpeg;base64," + base64.b64encode(f.read()).decode()
messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture?"}]}]
#   from openai import OpenAI
#   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(
#       model="llava-1.5-7b-hf", messages=messages)
