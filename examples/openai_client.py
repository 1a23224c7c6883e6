"""Talk to `flashpage serve` with the official OpenAI client (pip install openai).

    flashpage serve --port 8000 &
    python examples/openai_client.py
"""

import httpx
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
model = client.models.list().data[0].id

reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0, max_tokens=32)
print(reply.choices[0].message.content)

stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40,
                                   temperature=0.8, stream=True)
for chunk in stream:
    print(chunk.choices[0].text, end="", flush=True)
print()

# Score a continuation (what lm-eval-harness's loglikelihood requests do): the prompt echoed
# with its tokens' logprobs, the first token's null.
scored = client.completions.create(model=model, prompt="The capital of France is Paris",
                                   max_tokens=1, temperature=0, echo=True, logprobs=1)
lp = scored.choices[0].logprobs
print(list(zip(lp.tokens, lp.token_logprobs, strict=True))[-3:])

# Count tokens against the context without generating (vLLM's /tokenize).
print(httpx.post("http://127.0.0.1:8000/tokenize", json={"prompt": "Once upon a time"}).json())
