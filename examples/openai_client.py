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

# Structured outputs: JSON valid against a schema (OpenAI's response_format), or vLLM's
# guided_choice / guided_regex / structured_outputs through extra_body.
schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
          "required": ["capital"]}
as_json = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "The capital of France, as JSON."}],
    temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
print(as_json.choices[0].message.content)
label = client.completions.create(model=model, prompt="Paris is in Europe. True or false?",
                                  max_tokens=4, extra_body={"guided_choice": ["true", "false"]})
print(label.choices[0].text)

# Count tokens against the context without generating (vLLM's /tokenize).
print(httpx.post("http://127.0.0.1:8000/tokenize", json={"prompt": "Once upon a time"}).json())

# OpenAI's Responses API (POST /v1/responses), stored for a follow-up by previous_response_id.
first = client.responses.create(model=model, input="Name a primary color.", max_output_tokens=16,
                                temperature=0)
print(first.output_text)
follow = client.responses.create(model=model, input="And another one?", max_output_tokens=16,
                                 temperature=0, previous_response_id=first.id)
print(follow.output_text)

# Beam search on completions (vLLM's use_beam_search): n beams, best first.
beams = client.completions.create(model=model, prompt="The sky is", max_tokens=8, n=3,
                                  extra_body={"use_beam_search": True})
print([c.text for c in beams.choices])

# A reasoning model's thinking comes back apart from its answer when the server runs with
# --reasoning-parser (deepseek_r1, qwen3, ...): message.reasoning beside message.content.
