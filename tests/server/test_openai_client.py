"""The official `openai` client against a live server: answers equal offline LLM.generate."""

from __future__ import annotations

import openai
import pytest

from flashpage import SamplingParams

PROMPTS = ["the quick brown fox", "hello world, how are", "one two three four five six"]
CONVERSATION = [{"role": "system", "content": "you are a fox"},
                {"role": "user", "content": "hello, how are you today?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_completions_greedy_equals_offline(client, server, offline_llm):
    expected = offline_llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    r = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert len(r.choices) == len(PROMPTS)
    for choice, exp in zip(sorted(r.choices, key=lambda c: c.index), expected, strict=True):
        assert choice.text == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_token_id_prompts(client, server, offline_llm):
    prompts = [[5, 17, 99, 3, 200], [42] * 9]
    expected = offline_llm.generate(prompts, greedy(12, ignore_eos=True), use_tqdm=False)
    r = client.completions.create(model=server.model, prompt=prompts, max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    got = {c.index: c for c in r.choices}
    for i, exp in enumerate(expected):
        assert got[i].text == exp.outputs[0].text
        assert got[i].finish_reason == "length"
    assert r.usage.completion_tokens == 24

    # Several prompts with n = 2, streamed: choice prompt_index * n + i, as offline.
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    exp = offline_llm.generate(prompts, params, use_tqdm=False)
    want = {p * 2 + o.index: o.text for p, e in enumerate(exp) for o in e.outputs}
    got_text: dict[int, str] = {}
    for chunk in client.completions.create(model=server.model, prompt=prompts, n=2, seed=7,
                                           temperature=1.0, max_tokens=8, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            got_text[c.index] = got_text.get(c.index, "") + c.text
    assert got_text == want


def test_completions_stream_equals_offline(client, server, offline_llm):
    prompt = PROMPTS[0]
    exp = offline_llm.generate(prompt, greedy(30), use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(
        model=server.model, prompt=prompt, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == exp.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == exp.finish_reason and all(f is None for f in finishes[:-1])
    assert len(chunks) > 3  # streamed, not one blob
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(exp.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_offline(client, server, offline_llm):
    exp = offline_llm.chat(CONVERSATION, greedy(20), use_tqdm=False)[0]
    r = client.chat.completions.create(model=server.model, messages=CONVERSATION,
                                       max_completion_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.outputs[0].text
    assert r.choices[0].finish_reason == exp.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)

    stream = client.chat.completions.create(model=server.model, messages=CONVERSATION,
                                            max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == exp.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == exp.outputs[0].finish_reason


def test_chat_default_max_tokens_fills_context(client, server, offline_llm):
    """No max_tokens: the rest of the context (as vLLM), so 'length' ends exactly there."""
    from tests.server.conftest import MAX_MODEL_LEN

    exp = offline_llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=None,
                                                        ignore_eos=True), use_tqdm=False)[0]
    r = client.chat.completions.create(model=server.model, messages=CONVERSATION, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == MAX_MODEL_LEN
    assert r.choices[0].message.content == exp.outputs[0].text


def test_n_greater_than_one_seeded(client, server, offline_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    exp = offline_llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    texts = [o.text for o in sorted(exp.outputs, key=lambda o: o.index)]
    assert len(set(texts)) > 1  # the samples differ, so the index mapping is tested

    r = client.completions.create(model=server.model, prompt=PROMPTS[1], n=3, temperature=1.0,
                                  seed=1234, max_tokens=16, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == texts

    got = ["", "", ""]
    finishes: dict[int, str] = {}
    for chunk in client.completions.create(model=server.model, prompt=PROMPTS[1], n=3,
                                           temperature=1.0, seed=1234, max_tokens=16,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            got[c.index] += c.text
            if c.finish_reason:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    assert got == texts and finishes == {0: "length", 1: "length", 2: "length"}

    chat = offline_llm.chat(CONVERSATION, params, use_tqdm=False)[0]
    r = client.chat.completions.create(model=server.model, messages=CONVERSATION, n=3,
                                       temperature=1.0, seed=1234, max_tokens=16,
                                       extra_body={"ignore_eos": True})
    assert [c.message.content for c in r.choices] == \
        [o.text for o in sorted(chat.outputs, key=lambda o: o.index)]


def test_stop_strings(client, server, offline_llm):
    prompt = PROMPTS[2]
    full = offline_llm.generate(prompt, greedy(40, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    exp = offline_llm.generate(prompt, greedy(40, ignore_eos=True, stop=[stop, "\x00never"]),
                               use_tqdm=False)[0].outputs[0]
    assert exp.finish_reason == "stop" and exp.text == full[: full.index(stop)]

    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=40, temperature=0,
                                  stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert r.choices[0].text == exp.text and r.choices[0].finish_reason == "stop"

    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=40,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == exp.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client, server, offline_llm):
    prompt = PROMPTS[0]
    exp = offline_llm.generate(prompt, greedy(10, logprobs=3, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.token_logprobs == pytest.approx([x.logprob for x in exp.logprobs], abs=1e-5)
    for tops, x, tok in zip(lp.top_logprobs, exp.logprobs, lp.tokens, strict=True):
        assert 3 <= len(tops) <= 4 and tok in tops
        # greedy: the sampled token is the most likely one
        assert tops[tok] == pytest.approx(max(tops.values()))
        assert sorted(tops.values(), reverse=True)[:3] == pytest.approx([v for _, v in x.top], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    streamed = []
    for chunk in client.completions.create(model=server.model, prompt=prompt, max_tokens=10,
                                           temperature=0, logprobs=3, stream=True,
                                           extra_body={"ignore_eos": True}):
        streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(model=server.model, messages=CONVERSATION, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0
    r = client.chat.completions.create(model=server.model, messages=CONVERSATION, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].logprobs is None


def test_logit_bias_equals_offline(client, server, offline_llm):
    """OpenAI's logit_bias ({"token id": bias}) as offline SamplingParams.logit_bias."""
    bias = {7: 100.0, 9: -100.0}
    exp = offline_llm.generate(PROMPTS[:1], greedy(5, ignore_eos=True, logit_bias=bias),
                               use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  logit_bias={str(k): v for k, v in bias.items()},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == exp.text and exp.token_ids == [7] * 5


def test_tokenize_and_detokenize(server, offline_llm):
    """vLLM's /tokenize gives the ids the generation endpoints feed the model (a prompt, or
    a chat through the template); /detokenize turns ids back into the text."""
    import httpx

    url = server.url
    r = httpx.post(url + "/tokenize", json={"model": server.model, "prompt": PROMPTS[0]}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = offline_llm.engine.tokenize(PROMPTS[0])
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == offline_llm.engine.max_model_len
    plain = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False},
                       timeout=30).json()["tokens"]
    assert plain == ids[1:] and ids[0] == 1  # the bos the template processor adds
    chat = httpx.post(url + "/tokenize", json={"messages": CONVERSATION}, timeout=30).json()
    tok = offline_llm.engine.tokenizer
    assert chat["tokens"] == list(tok.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False))
    r = httpx.post(url + "/detokenize", json={"tokens": plain}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == PROMPTS[0]
    for path, bad, needle in (("/tokenize", {}, "exactly one of prompt and messages"),
                              ("/tokenize", {"prompt": "a", "messages": CONVERSATION}, "exactly one"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/detokenize", {"tokens": [5, 256]}, "outside the vocabulary"),
                              ("/detokenize", {"tokens": "hi"}, "tokens"),
                              ("/tokenize", {"model": "other", "prompt": "a"}, "does not exist")):
        r = httpx.post(url + path, json=bad, timeout=30)
        assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], (path, bad, r.text)


def test_echo_with_logprobs_scores_the_prompt(client, server, offline_llm):
    """lm-eval-harness's loglikelihood request (echo, logprobs 1, max_tokens 1): the prompt
    comes back before the completion, its tokens' logprobs are the offline prompt_logprobs
    (null for the first), then the completion's."""
    exp = offline_llm.generate(PROMPTS[:1], greedy(1, prompt_logprobs=1, logprobs=1),
                               use_tqdm=False)[0]
    r = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPTS[0] + exp.outputs[0].text
    lp = c.logprobs
    n = len(exp.prompt_token_ids)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, want in zip(lp.token_logprobs[1:n], exp.prompt_logprobs[1:], strict=True):
        assert abs(got - want.logprob) < 1e-4
    assert abs(lp.token_logprobs[n] - exp.outputs[0].logprobs[0].logprob) < 1e-4
    assert lp.text_offset == sorted(lp.text_offset)
    # token-id prompts echo their decoded text; without logprobs no prompt scoring is asked
    ids = offline_llm.engine.tokenize(PROMPTS[1])
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(offline_llm.engine.tokenizer.decode(ids))
    assert r.choices[0].logprobs is None


def test_echo_streamed_equals_echo_answered(client, server):
    """Streamed, the echoed prompt (and its scored tokens) comes first in each choice's first
    chunk; joined, the chunks give the non-streamed answer's text and logprobs."""
    kw = dict(model=server.model, prompt=PROMPTS[2], max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, lps = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
    assert text == whole.text and text.startswith(PROMPTS[2])
    assert tokens == whole.logprobs.tokens and lps == whole.logprobs.token_logprobs


def test_prompt_logprobs_as_vllm_returns_them(client, server, offline_llm):
    """vLLM's prompt_logprobs extra: per prompt token null for the first, else {token id:
    {logprob, rank, decoded_token}} with the token itself and its top alternatives."""
    exp = offline_llm.generate(PROMPTS[:1], greedy(1, prompt_logprobs=2), use_tqdm=False)[0]
    r = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(exp.prompt_token_ids) and plp[0] is None
    for entry, want, tok in zip(plp[1:], exp.prompt_logprobs[1:], exp.prompt_token_ids[1:], strict=True):
        assert abs(entry[str(tok)]["logprob"] - want.logprob) < 1e-4 and entry[str(tok)]["rank"] == want.rank
        assert {str(t) for t, _ in want.top} <= set(entry) and len(entry) <= 3
    chat = client.chat.completions.create(model=server.model, messages=CONVERSATION, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    plp = chat.model_dump()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_chat_template_override(tiny_model_dir, tmp_path):
    """chat_template (vLLM's --chat-template): the text or a file replaces the tokenizer's
    template; a Jinja syntax error is named when the engine starts; so is a model without
    a tokenizer."""
    from flashpage import LLM
    from tests.server.conftest import engine_kwargs

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    conv = [{"role": "user", "content": "hello there"}]
    for given in (template, str(tmp_path / "t.jinja")):
        (tmp_path / "t.jinja").write_text(template)
        llm = LLM(str(tiny_model_dir), chat_template=given, **engine_kwargs())
        tok = llm.engine.tokenizer
        want = tok.encode("[user] hello there\n[assistant]", add_special_tokens=False)
        assert llm.chat_prompt_ids(conv) == want
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        LLM(str(tiny_model_dir), chat_template="{% for m in messages %}", **engine_kwargs())
    import argparse

    from flashpage.cli import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)  # generate, chat, serve and bench share these
    assert parser.parse_args(["--chat-template", "x.jinja"]).chat_template == "x.jinja"


def test_truncate_prompt_tokens_and_version(client, server, offline_llm):
    """A prompt past the context is refused, unless truncate_prompt_tokens cuts it from the
    front (then it answers as the kept tokens would); GET /version."""
    import httpx

    ids = [5, 17, 99, 3, 200] * 40  # 200 tokens: past the test server's context
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=ids, max_tokens=3, temperature=0)
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=3, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 20, "ignore_eos": True})
    exp = offline_llm.generate([ids[-20:]], greedy(3, ignore_eos=True), use_tqdm=False)[0]
    assert r.choices[0].text == exp.outputs[0].text and r.usage.prompt_tokens == 20
    chat = client.chat.completions.create(model=server.model, messages=CONVERSATION, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    from flashpage import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_allowed_token_ids_equal_offline(client, server, offline_llm):
    """vLLM's allowed_token_ids extra: every generated token among them, as offline."""
    allowed = [7, 9, 11]
    exp = offline_llm.generate(PROMPTS[:1], greedy(4, ignore_eos=True, allowed_token_ids=allowed),
                               use_tqdm=False)[0].outputs[0]
    assert set(exp.token_ids) <= set(allowed)
    r = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert r.choices[0].text == exp.text
