"""Image input with a SmolVLM or Idefics3 checkpoint (SmolVLM-256M / 500M-Instruct,
SmolVLM2's images, Idefics3-8B-Llama3), through the chat template and as a raw prompt.

    python examples/smolvlm_image.py path/to/SmolVLM-256M-Instruct photo.jpg

The image's longest edge is resized to the processor's size (here 2 x 512: mm_processor_kwargs
size), cut into 512 x 512 tiles and the whole image as one more, 64 prompt positions a tile;
a raw prompt holds one <image> per image, which the engine writes out as Idefics3Processor
does (<fake_token_around_image>, <row_r_col_c>, the rows, <global-img> ...).
"""

import sys

from PIL import Image

from flashpage import LLM, SamplingParams

model, path = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype="bfloat16", mm_processor_kwargs={"size": {"longest_edge": 1024}})
image = Image.open(path)
params = SamplingParams(temperature=0, max_tokens=64)

messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is in this picture?"}]}]
print(llm.chat(messages, params)[0].outputs[0].text)

prompt = "<|im_start|>User:<image>What is in this picture?<end_of_utterance>\nAssistant:"
out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params)
print(out[0].outputs[0].text, f"({len(out[0].prompt_token_ids)} prompt tokens)")
