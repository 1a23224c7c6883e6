"""64 concurrent clients, streaming and not, completions and chat: every answer complete
and equal to the offline one; afterwards no request runs and no KV block is in use."""

from __future__ import annotations

import asyncio
import random

import openai

from flashpage import SamplingParams

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world",
         "how", "are", "you", "today", "one", "two", "three", "four", "five", "six", "seven",
         "eight", "nine", "ten", "paged", "cache", "keys", "values"]
NUM_CLIENTS = 64


def make_jobs(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shared = " ".join(rng.choices(WORDS, k=12))  # a common prefix: shared cached blocks
    jobs = []
    for i in range(NUM_CLIENTS):
        words = " ".join(rng.choices(WORDS, k=rng.randint(2, 20)))
        text = f"{shared} {words}" if i % 3 == 0 else words
        jobs.append(dict(kind="chat" if i % 4 >= 2 else "completion", stream=i % 2 == 1,
                         text=text, max_tokens=rng.randint(4, 28)))
    return jobs


async def run_job(client: openai.AsyncOpenAI, model: str, job: dict) -> tuple[str, str, int]:
    common = dict(model=model, max_tokens=job["max_tokens"], temperature=0)
    if job["kind"] == "completion":
        if not job["stream"]:
            r = await client.completions.create(prompt=job["text"], **common)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        text, finish, usage = "", None, None
        stream = await client.completions.create(prompt=job["text"], stream=True,
                                                 stream_options={"include_usage": True}, **common)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finish, usage
    messages = [{"role": "user", "content": job["text"]}]
    if not job["stream"]:
        r = await client.chat.completions.create(messages=messages, **common)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish, usage = "", None, None
    stream = await client.chat.completions.create(messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **common)
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


def test_64_concurrent_clients(server, offline_llm):
    jobs = make_jobs()
    assert {(j["kind"], j["stream"]) for j in jobs} == {
        ("completion", False), ("completion", True), ("chat", False), ("chat", True)}
    expected = []
    for j in jobs:
        params = SamplingParams(temperature=0.0, max_tokens=j["max_tokens"])
        if j["kind"] == "completion":
            out = offline_llm.generate(j["text"], params, use_tqdm=False)[0]
        else:
            out = offline_llm.chat([{"role": "user", "content": j["text"]}], params,
                                   use_tqdm=False)[0]
        o = out.outputs[0]
        expected.append((o.text, o.finish_reason, len(o.token_ids)))
    before = server.metrics()

    async def main() -> list[tuple[str, str, int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(run_job(client, server.model, j) for j in jobs))

    results = asyncio.run(main())
    for i, (got, exp) in enumerate(zip(results, expected, strict=True)):
        assert got == exp, f"client {i} ({jobs[i]}): {got} != {exp}"

    after = server.wait_idle()
    assert after["flashpage:kv_cache_blocks_used"] == 0
    assert after["flashpage:num_requests_running"] == 0
    assert after["flashpage:num_requests_waiting"] == 0
    assert after["flashpage:kv_cache_usage_perc"] == 0

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    finished = sum(delta(f'flashpage:request_finished_total{{finish_reason="{r}"}}')
                   for r in ("stop", "length", "abort"))
    assert finished == NUM_CLIENTS
    assert delta('flashpage:request_finished_total{finish_reason="abort"}') == 0
    assert delta("flashpage:generation_tokens_total") == sum(e[2] for e in expected)
    assert delta("flashpage:time_to_first_token_seconds_count") == NUM_CLIENTS
