"""Tool calls through `flashpage serve` with the official OpenAI client (pip install openai).

    flashpage serve --port 8000 &                       # forced calls need no parser
    # a model trained on a call format lets the model decide (tool_choice "auto"):
    # flashpage serve /models/Qwen2.5-7B-Instruct --tool-call-parser hermes --enable-auto-tool-choice
    python examples/tool_calls.py
"""

import json

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
model = client.models.list().data[0].id

tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}]
messages = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]

# A named function: its arguments always parse and follow its schema.
reply = client.chat.completions.create(
    model=model, messages=messages, tools=tools, temperature=0, max_tokens=60,
    tool_choice={"type": "function", "function": {"name": "get_weather"}})
call = reply.choices[0].message.tool_calls[0]
args = json.loads(call.function.arguments)
print(call.function.name, args, reply.choices[0].finish_reason)  # ... tool_calls

# Streamed, as vLLM streams calls: the name first, then the arguments piece by piece
# (joined, the pieces are the non-streamed arguments).
for chunk in client.chat.completions.create(
        model=model, messages=messages, tools=tools, temperature=0, max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}):
    for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
        print(delta.function.name or "", delta.function.arguments or "", sep="", end="|", flush=True)
print()

# Answer the call and let the model go on with the tool's result.
messages += [reply.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", **args})}]
final = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=60)
print(final.choices[0].message.content)
