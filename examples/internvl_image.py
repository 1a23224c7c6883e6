"""Image input with an InternVL3 / InternVL3.5 checkpoint (transformers' -hf layout, or
OpenGVLab's remote-code one), through the chat template and as a raw prompt.

    python examples/internvl_image.py path/to/InternVL3-2B-hf photo.jpg

Each image is cut into 448 x 448 tiles (1 to 12 here: mm_processor_kwargs max_patches; plus
a thumbnail when there are several), 256 prompt positions a tile. A raw prompt holds one
<IMG_CONTEXT> per image (the remote-code layout's "<image>" is taken too); the engine writes
<img> ... </img> around its rows.
"""

import sys

from PIL import Image

from flashpage import LLM, SamplingParams

model, path = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype="bfloat16", mm_processor_kwargs={"max_patches": 6})
image = Image.open(path)
params = SamplingParams(temperature=0, max_tokens=64)

messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is in this picture?"}]}]
print(llm.chat(messages, params)[0].outputs[0].text)

prompt = "<|im_start|>user\n<IMG_CONTEXT>\nWhat is in this picture?<|im_end|>\n<|im_start|>assistant\n"
out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params)
print(out[0].outputs[0].text, f"({len(out[0].prompt_token_ids)} prompt tokens)")
