"""Audio input with Qwen2-Audio (Qwen/Qwen2-Audio-7B-Instruct), through the chat template
and as a raw prompt.

    python examples/qwen2_audio.py path/to/Qwen2-Audio-7B-Instruct clip.wav

The chat part is OpenAI's input_audio (the file's bytes in base64: WAV through the standard
library, MP3 / FLAC / ... through PyAV, pip install av); the raw prompt takes the waveform
and its sampling rate, as vLLM's multi_modal_data does, resampled to the model's 16 kHz.
An audio is up to 30 s: 25 prompt tokens a second.
"""

import base64
import sys
from pathlib import Path

from flashpage import LLM, SamplingParams
from flashpage.engine.audio_io import decode_audio

model, path = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype="bfloat16")
raw = Path(path).read_bytes()
params = SamplingParams(temperature=0, max_tokens=64)

messages = [{"role": "user", "content": [
    {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": "wav"}},
    {"type": "text", "text": "What is that sound?"}]}]
print(llm.chat(messages, params)[0].outputs[0].text)

waveform, rate = decode_audio(raw)  # mono float32 samples and their rate
prompt = ("<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
          "Transcribe it.<|im_end|>\n<|im_start|>assistant\n")
out = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": (waveform, rate)}}, params)
print(out[0].outputs[0].text, f"({len(out[0].prompt_token_ids)} prompt tokens)")
