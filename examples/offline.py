"""Offline generation with the default model (SmolLM2-135M-Instruct): text, chat, sampling."""

from flashpage import LLM, SamplingParams

llm = LLM()  # or LLM("path/to/hf_folder_or_file.gguf", dtype="bfloat16")

greedy = SamplingParams(temperature=0.0, max_tokens=32)
for out in llm.generate(["The three primary colors are", "def fibonacci(n):"], greedy):
    print(repr(out.outputs[0].text), out.outputs[0].finish_reason)

chat = llm.chat([{"role": "user", "content": "Give me one tip for writing clear code."}],
                SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=1))
print(chat[0].outputs[0].text)

# Several samples of one prompt share its cached KV blocks.
samples = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=0))
for s in samples[0].outputs:
    print(s.index, repr(s.text))

# Score continuations, as evaluation harnesses do: each prompt token's logprob given the
# ones before it (prompt_logprobs; the first token has none).
context = "The capital of France is"
for answer in (" Paris", " Berlin"):
    scored = llm.generate(context + answer, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    n = len(scored.prompt_token_ids) - len(llm.engine.tokenize(context))  # the answer's tokens
    print(repr(answer), round(sum(lp.logprob for lp in scored.prompt_logprobs[-n:]), 2))

# Steer the sampler: the likeliest answer's first token banned (OpenAI's logit_bias).
paris = llm.engine.tokenize(context + " Paris")[len(llm.engine.tokenize(context))]
banned = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={paris: -100.0})
print(repr(llm.generate(context, banned)[0].outputs[0].text))

# Beam search (vLLM's LLM.beam_search): the 3 likeliest continuations by length-penalized
# log-probability, best first.
from flashpage import BeamSearchParams  # noqa: E402

for seq in llm.beam_search("The best way to learn a language is",
                           BeamSearchParams(beam_width=3, max_tokens=12))[0].sequences:
    print(round(seq.cum_logprob, 2), repr(seq.text))

# Words the output may not contain (vLLM's bad_words), and the model's own sampling defaults
# (its generation_config.json, what generate() uses without SamplingParams).
print(llm.generate("My favourite fruit is", SamplingParams(temperature=0, max_tokens=12,
                                                           bad_words=["apple", "banana"]))[0].outputs[0].text)
print(llm.get_default_sampling_params())
