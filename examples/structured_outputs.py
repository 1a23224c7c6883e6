"""Structured outputs with the default model: a JSON schema, a choice, a regex, a grammar.

The output is constrained token by token (tokens that would leave the pattern are never
sampled) and the request ends once the pattern is complete. The server takes the same
through OpenAI's response_format or vLLM's guided_* / structured_outputs fields:

    client.chat.completions.create(..., response_format={"type": "json_schema",
        "json_schema": {"name": "city", "schema": SCHEMA}})
    client.completions.create(..., extra_body={"guided_choice": ["positive", "negative"]})
"""

import json

from flashpage import LLM, SamplingParams, StructuredOutputsParams

llm = LLM()

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "country", "landmarks"],
}
ask = [{"role": "user", "content": "Describe Paris as JSON with city, country, population_millions "
                                   "and landmarks."}]
out = llm.chat(ask, SamplingParams(temperature=0, max_tokens=200,
                                   structured_outputs=StructuredOutputsParams(json=SCHEMA)))[0]
print(json.loads(out.outputs[0].text))  # always parses: the schema's shape, in its key order

review = [{"role": "user", "content": "Is this review positive or negative? 'The food was cold "
                                      "and the waiter rude.'"}]
label = StructuredOutputsParams(choice=["positive", "negative"])
print(llm.chat(review, SamplingParams(temperature=0, structured_outputs=label))[0].outputs[0].text)

date = StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}")
when = [{"role": "user", "content": "When did the Berlin Wall fall? Answer as YYYY-MM-DD."}]
print(llm.chat(when, SamplingParams(temperature=0, structured_outputs=date))[0].outputs[0].text)

# A context-free grammar (GBNF, as vLLM / llama.cpp / xgrammar write it; Lark's `start: ...`
# syntax works too). This one is recursive - parentheses nest - so a regex could not say it.
ARITH = r"""
root   ::= expr
expr   ::= term (" " ("+" | "-") " " term)*
term   ::= factor (" * " factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
calc = [{"role": "user", "content": "Write an arithmetic expression equal to 42, with parentheses."}]
expr = StructuredOutputsParams(grammar=ARITH)
print(llm.chat(calc, SamplingParams(temperature=0, max_tokens=40, structured_outputs=expr))[0].outputs[0].text)
