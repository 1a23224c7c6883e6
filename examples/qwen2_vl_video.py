"""Video input with a Qwen2-VL / Qwen2.5-VL checkpoint (vLLM's multimodal prompts), offline.

    python examples/qwen2_vl_video.py path/to/Qwen2.5-VL-3B-Instruct frame0.jpg frame1.jpg ...

flashpage decodes no video file: give the frames you sampled (a uint8 (T, H, W, 3) array or a
list of PIL images), with their frame rate where it matters (Qwen2.5-VL's temporal
positions: metadata {"fps": ...}, or LLM(mm_processor_kwargs={"fps": ...}) for all videos).
One <|vision_start|><|video_pad|><|vision_end|> in the prompt per video; LLM.chat's
{"type": "video", "video": frames} parts put it where the checkpoint's template does.
"""

import sys

from PIL import Image

from flashpage import LLM, SamplingParams

model, paths = sys.argv[1], sys.argv[2:]
frames = [Image.open(p).convert("RGB") for p in paths]
llm = LLM(model, dtype="bfloat16", limit_mm_per_prompt={"image": 1, "video": 1})
params = SamplingParams(temperature=0, max_tokens=64)

prompt = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens in this "
          "video?<|im_end|>\n<|im_start|>assistant\n")
out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": (frames, {"fps": 2.0})}}, params)
print(out[0].outputs[0].text)

messages = [{"role": "user", "content": [{"type": "video", "video": frames},
                                         {"type": "text", "text": "Describe the video."}]}]
print(llm.chat(messages, params)[0].outputs[0].text)
