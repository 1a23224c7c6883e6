"""Talk to `flashpage serve` with the official OpenAI client (pip install openai).

    flashpage serve --port 8000 &
    python examples/openai_client.py
"""

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
