"""Speculative decoding by n-gram lookup (vLLM's speculative_config={"method": "ngram"}).

A request whose last tokens occurred earlier in its prompt or output runs the tokens that
followed them as drafts; one step checks them all and keeps those the model agrees with.
It pays where outputs repeat their input: editing or quoting a text, code, extraction.
Greedy tokens are the same with and without it.
"""

import time

from flashpage import LLM, SamplingParams

text = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
messages = [{"role": "user", "content": "Rename width to w and height to h in this code, and "
                                        "give back the whole code:\n\n" + text}]
params = SamplingParams(temperature=0.0, max_tokens=120)

for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}):
    llm = LLM(speculative_config=spec)
    llm.chat(messages, params, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    dt = time.perf_counter() - t0
    print(f"--- speculative_config={spec}: {len(out.token_ids)} tokens in {dt:.2f}s, "
          f"{llm.engine.scheduler.num_steps} steps in all")
    print(out.text)
    if spec is not None:
        print(llm.engine.stats()["spec_decode"])
