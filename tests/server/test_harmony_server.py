"""GPT-OSS's harmony format through the server: ``--tool-call-parser openai`` (with
``openai_gptoss``'s channels in front of it) answering reasoning_content, content and
tool_calls, streamed and not; the chat template shown tools, earlier calls, tool results and
reasoning_effort; the requests decoding with special tokens kept and stopping at <|call|> and
<|return|>. The tiny model's answers are forced by a guided choice, whose text spells the
markers out in ordinary tokens (structured outputs never write special tokens), so the
server reads the same text GPT-OSS's special tokens decode to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer, live_server
from tests.server.test_errors import assert_error, post
from tests.server.test_tools import MESSAGES, TOOLS, _chat, _check_call, _stream, _streamed

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
                  "<|constrain|>"]
# a harmony-like template in the shape of gpt-oss-20b's (system / developer messages, earlier
# calls to functions, tool results from functions.NAME to the assistant), not a copy of it
TEMPLATE = (
    "{%- set ns = namespace(last='') -%}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|>tools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- if m.content and m.thinking %}{{ raise_exception('content and thinking both') }}{% endif -%}"
    "{%- if m.thinking or m.content %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking or m.content }}<|end|>{% endif -%}"
    "{%- for c in m.tool_calls -%}"
    "{%- set ns.last = c.function.name -%}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"
)


@pytest.fixture(scope="module")
def harmony_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama whose byte-level tokenizer also has harmony's markers as special
    tokens (ids 320-326) and the template above."""
    from transformers import AutoTokenizer

    from tests.byte_tokenizer import VOCAB_SIZE, build_byte_tokenizer
    from tests.conftest import build_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_harmony")
    build_tiny_checkpoint(path, "llama2_mha", vocab_size=VOCAB_SIZE + len(HARMONY_TOKENS))
    build_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    assert [tok.convert_tokens_to_ids(t) for t in HARMONY_TOKENS] == list(range(VOCAB_SIZE, VOCAB_SIZE + 7))
    return path


@pytest.fixture(scope="module")
def harmony_server(harmony_model_dir) -> Iterator[LiveServer]:
    """--tool-call-parser openai alone, as vLLM's gpt-oss recipe starts it (the channels'
    reasoning parser comes with it); structured outputs over the whole answer, to force it."""
    with live_server(harmony_model_dir, engine_kw={"max_model_len": 1024}, tool_call_parser="openai",
                     enable_auto_tool_choice=True, structured_outputs_in_reasoning=True) as s:
        yield s


WEATHER_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}<|call|>')
TWO_CALLS = ("<|channel|>analysis<|message|>Both.<|end|><|start|>assistant<|channel|>commentary<|message|>"
             "Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
             '{"city": "Paris", "days": 3}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time '
             '<|constrain|>json<|message|>{"zone": "UTC"}<|call|>')
ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"


def _reasoning(chunks: list[dict]) -> str:
    out = ""
    for chunk in chunks:
        for c in chunk["choices"]:
            d = c["delta"]
            assert d.get("reasoning") == d.get("reasoning_content")
            out += d.get("reasoning") or ""
    return out


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (WEATHER_CALL, "Need the weather.", None, [("get_weather", {"city": "Paris", "days": 3})]),
    (TWO_CALLS, "Both.", "Checking.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]),
    (ANSWER, "Easy.", "It is sunny.", []),
])
def test_reasoning_content_and_calls(harmony_server, text, reasoning, content, calls):
    body = {"tools": TOOLS, "guided_choice": [text], "max_tokens": 600}
    choice = _chat(harmony_server, body).json()["choices"][0]
    msg = choice["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == reasoning
    assert msg["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert got == calls
    for call in msg.get("tool_calls", []):
        _check_call(call)
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
    chunks = _stream(harmony_server, body)
    streamed_content, streamed_calls, finish = _streamed(chunks)
    assert _reasoning(chunks) == reasoning and streamed_content == (content or "")
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in msg.get("tool_calls", [])]
    assert finish == choice["finish_reason"]


def test_no_tools_in_the_request(harmony_server):
    """Without tools the channels are still read: reasoning apart, the final answer content."""
    r = _chat(harmony_server, {"guided_choice": [ANSWER], "max_tokens": 300})
    msg = r.json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Easy.", "It is sunny.")
    r = _chat(harmony_server, {"guided_choice": [ANSWER], "max_tokens": 300, "include_reasoning": False})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}


def test_special_tokens_kept_and_turns_end_at_call_and_return(harmony_server, harmony_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harmony_model_dir)
    ends = sorted(tok.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    engine = harmony_server.async_engine.engine
    seen = []
    add = engine.add_request

    def spy(*args, **kw):
        seen.append((args[2].skip_special_tokens, args[2].stop_token_ids))
        return add(*args, **kw)

    engine.add_request = spy
    try:
        r = _chat(harmony_server, {"max_tokens": 3})
    finally:
        del engine.add_request
    assert r.status_code == 200, r.text
    assert seen == [(False, ends)]


def test_the_template_sees_tools_calls_results_and_effort(harmony_server, harmony_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harmony_model_dir)
    msgs = [*MESSAGES, {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"messages": msgs, "tools": TOOLS, "reasoning_effort": "high"}
    r = post(harmony_server, "/tokenize", body)
    assert r.status_code == 200, r.text
    text = tok.decode(r.json()["tokens"])
    assert "<|start|>system<|message|>Reasoning: high<|end|>" in text
    assert "<|start|>developer<|message|>tools: get_weather get_time<|end|>" in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris", "days": 3}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=" in text
    assert text.endswith("<|start|>assistant")
    # the chat endpoint gives the template the same
    chat = post(harmony_server, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(r.json()["tokens"])
    default = post(harmony_server, "/tokenize", {"messages": msgs})
    assert "Reasoning: medium" in tok.decode(default.json()["tokens"])
    same = post(harmony_server, "/tokenize", {**body, "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert same.json()["tokens"] == r.json()["tokens"]
    assert_error(post(harmony_server, "/v1/chat/completions", {**body, "chat_template_kwargs": {
        "reasoning_effort": "low"}}), 400, "differ", param="reasoning_effort")
    assert_error(post(harmony_server, "/v1/chat/completions", {**body, "reasoning_effort": "max"}), 400,
                 param="reasoning_effort")
    # a tool-calling turn sent back with a preamble and its reasoning: a template that, as
    # GPT-OSS's, refuses content and thinking both answers a 400 saying so; content alone is
    # its analysis
    both = [*MESSAGES, {**msgs[1], "content": "Checking."}, msgs[2]]
    assert_error(post(harmony_server, "/tokenize", {"messages": both, "tools": TOOLS}), 400,
                 "content and thinking both", param="messages")
    del both[1]["reasoning_content"]
    r = post(harmony_server, "/tokenize", {"messages": both, "tools": TOOLS})
    assert "<|channel|>analysis<|message|>Checking.<|end|>" in tok.decode(r.json()["tokens"])
    # the Responses API's reasoning.effort is the same
    one = [{"role": "user", "content": "hi"}]
    want = post(harmony_server, "/tokenize", {"messages": one, "reasoning_effort": "low"}).json()["count"]
    assert want != post(harmony_server, "/tokenize", {"messages": one}).json()["count"]
    resp = post(harmony_server, "/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}, "max_output_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["input_tokens"] == want and resp.json()["reasoning"]["effort"] == "low"


def test_structured_outputs_need_the_whole_answer(harmony_model_dir):
    """Without --structured-outputs-in-reasoning a pattern would have to start after the
    analysis channel, which is not done: a clear 400, not a pattern that never matches."""
    with live_server(harmony_model_dir, engine_kw={"max_model_len": 512}, reasoning_parser="openai_gptoss",
                     tool_call_parser="openai", enable_auto_tool_choice=True) as s:
        assert_error(_chat(s, {"guided_choice": ["x"], "max_tokens": 5}), 400, "openai_gptoss",
                     param="guided_choice")
        assert_error(_chat(s, {"tools": TOOLS, "tool_choice": "required", "max_tokens": 5}), 400,
                     "--structured-outputs-in-reasoning", param="tool_choice")
        r = _chat(s, {"max_tokens": 4})  # a plain request: generated, read as harmony
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["reasoning"] is None
    with pytest.raises(ValueError, match="reads openai_gptoss's output"), \
            live_server(harmony_model_dir, tool_call_parser="openai", reasoning_parser="qwen3"):
        pass


def test_a_continued_final_message(harmony_server):
    """continue_final_message: the prompt ends inside the final channel's body (its header
    more than a few tokens back), so the output is content from its first token, streamed as
    it comes (not held back as a header would be)."""
    msgs = [*MESSAGES, {"role": "assistant", "content": "The forecast for Paris over the next three days is"}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
            "guided_choice": [" sunny and warm.<|return|>"], "max_tokens": 60}
    msg = post(harmony_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == (None, " sunny and warm.")
    chunks = _stream(harmony_server, body)
    early = [c["choices"][0]["delta"].get("content") for c in chunks
             if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len([piece for piece in early if piece]) >= 3, early
    assert _streamed(chunks)[0] == " sunny and warm."
