"""Reasoning parsers (server/reasoning.py, vLLM's --reasoning-parser): the thinking between
<think> and </think> answered as the message's reasoning, streamed or not; the chat
template's kwargs (chat_template_kwargs, add_generation_prompt, continue_final_message)."""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flashpage.server.reasoning import REASONING_PARSERS, ReasoningSplitter, get_reasoning_parser
from tests.server.conftest import LiveServer, live_server
from tests.server.test_errors import assert_error, post

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% if thinking %}<think>{% endif %}{% endif %}")


def _reference(text: str, implicit: bool, opened: bool) -> tuple[str | None, str]:
    """The split, written plainly: thinking if the output opens with <think> (after
    whitespace) or the format / prompt opens it; it ends at the first </think>."""
    body = text.lstrip()
    if body.startswith("<think>"):
        rest = body[len("<think>"):]
    elif implicit or opened:
        rest = text
    else:
        return None, text
    end = rest.find("</think>")
    return (rest, "") if end < 0 else (rest[:end], rest[end + len("</think>"):])


@pytest.mark.parametrize("name", sorted(n for n, f in REASONING_PARSERS.items() if not f.harmony))  # <think> ones
@pytest.mark.parametrize("opened", [False, True])
def test_streamed_pieces_add_up_to_the_split(name, opened):
    """Random texts of tag fragments cut at random: the streamed deltas add up to the
    non-streamed split, which is the plain reference's."""
    fmt = get_reasoning_parser(name)
    tail = "assistant:<think>\n" if opened else "assistant:"
    rng = random.Random(hash((name, opened)) & 0xFFFF)
    parts = ["<think>", "</think>", "<", "</", "<th", "think>", "ink>", "a", "bc", " ", "\n", "x<y"]
    for _ in range(400):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8)))
        want = _reference(text, fmt.implicit_start, opened)
        assert ReasoningSplitter(fmt, tail).split(text) == want, text
        rs, r_all, c_all = ReasoningSplitter(fmt, tail), "", ""
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        for i, piece in enumerate(pieces):
            r, c = rs.finish(piece) if i == len(pieces) - 1 else rs.feed(piece)
            r_all, c_all = r_all + r, c_all + c
        assert (r_all, c_all) == (want[0] or "", want[1]), (text, pieces)


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        get_reasoning_parser("nope")


@pytest.fixture(scope="module")
def think_model_dir(byte_model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_think")
    shutil.copytree(byte_model_dir, path, dirs_exist_ok=True)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_file.write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def think_server(request, think_model_dir) -> Iterator[LiveServer]:
    """Structured outputs cover the thinking here (vLLM's enable_in_reasoning), so the tests
    can force an output with one."""
    with live_server(think_model_dir, reasoning_parser=request.param,
                     structured_outputs_in_reasoning=True) as s:
        s.parser = request.param  # type: ignore[attr-defined]
        yield s


def _chat(server, regex: str, stream: bool = False, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"regex": regex}, "stream": stream, **kw}
    return post(server, "/v1/chat/completions", body)


def _streamed(r: httpx.Response) -> tuple[str, str]:
    assert r.status_code == 200, r.text
    reasoning = content = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                d = ch["delta"]
                assert d.get("reasoning") == d.get("reasoning_content")
                reasoning += d.get("reasoning") or ""
                content += d.get("content") or ""
    return reasoning, content


@pytest.mark.parametrize("opening", ["<think>", ""])
def test_reasoning_apart_from_content(think_server, opening):
    r = _chat(think_server, opening + "[a-z]{3,6}</think>[a-z]{2,6}")
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    head, tail = msg["content"], msg["reasoning"]
    if opening or think_server.parser == "deepseek_r1":
        assert msg["reasoning"] == msg["reasoning_content"]
        assert 3 <= len(tail) <= 6 and tail.isalpha() and 2 <= len(head) <= 6 and head.isalpha()
        assert _streamed(_chat(think_server, opening + "[a-z]{3,6}</think>[a-z]{2,6}", stream=True)) \
            == (tail, head)
    else:  # qwen3 without an opening tag: all content
        assert msg["reasoning"] is None and "</think>" in head
    no = _chat(think_server, opening + "[a-z]{3,6}</think>[a-z]{2,6}", include_reasoning=False)
    assert "reasoning" not in no.json()["choices"][0]["message"]
    assert no.json()["choices"][0]["message"]["content"] == head
    assert think_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_a_template_that_opens_the_thinking(think_server):
    """chat_template_kwargs {"thinking": true}: the prompt ends with <think>, so the output is
    thinking from its first token, whichever parser."""
    r = _chat(think_server, "[a-z]{3,6}</think>[a-z]{2,6}", chat_template_kwargs={"thinking": True})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning"] and msg["reasoning"].isalpha() and msg["content"].isalpha()


def test_template_fields(think_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(think_model_dir)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    with live_server(think_model_dir) as s:
        body = {"messages": msgs, "max_tokens": 2, "temperature": 0}
        assert_error(post(s, "/v1/chat/completions", {**body, "chat_template_kwargs": {"tokenize": False}}),
                     400, "tokenize", param="chat_template_kwargs")
        assert_error(post(s, "/v1/chat/completions", {**body, "continue_final_message": True}),
                     400, "add_generation_prompt", param="continue_final_message")
        r = post(s, "/v1/chat/completions", {**body, "continue_final_message": True,
                                             "add_generation_prompt": False})
        want = tok.apply_chat_template(msgs, continue_final_message=True, add_generation_prompt=False,
                                       tokenize=True, return_dict=False)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        r = post(s, "/v1/chat/completions", {**body, "chat_template_kwargs": {"thinking": True}})
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, thinking=True,
                                       tokenize=True, return_dict=False)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        assert "reasoning" not in r.json()["choices"][0]["message"]  # no parser: no field


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_structured_outputs_start_after_the_thinking(parser, think_model_dir):
    """With a reasoning parser the pattern starts after </think>. '<' barred: qwen3's
    output cannot open a thinking, so it is the pattern from the first token; deepseek_r1's
    is thinking from the first token and, unable to close it, runs to max_tokens."""
    from transformers import AutoTokenizer

    lt = AutoTokenizer.from_pretrained(think_model_dir).encode("<", add_special_tokens=False)
    assert len(lt) == 1
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
            "structured_outputs": {"regex": "[a-z]{2,6}"}, "logit_bias": {str(lt[0]): -100}}
    with live_server(think_model_dir, reasoning_parser=parser) as s:
        choice = post(s, "/v1/chat/completions", body).json()["choices"][0]
    if parser == "qwen3":
        assert choice["finish_reason"] == "stop" and choice["message"]["reasoning"] is None
        assert re.fullmatch("[a-z]{2,6}", choice["message"]["content"])
    else:
        assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
        assert choice["message"]["reasoning"] and "<" not in choice["message"]["reasoning"]


def test_tokenize_takes_the_template_fields(think_model_dir):
    """/tokenize gives the ids chat would feed the model for the same template fields."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(think_model_dir)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    with live_server(think_model_dir) as s:
        r = post(s, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"thinking": True}})
        assert r.json()["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=True, thinking=True,
                                                             tokenize=True, return_dict=False)
        r = post(s, "/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                  "continue_final_message": True})
        assert r.json()["tokens"] == tok.apply_chat_template(msgs, continue_final_message=True,
                                                             tokenize=True, return_dict=False)
        assert_error(post(s, "/tokenize", {"messages": msgs, "continue_final_message": True}), 400,
                     "add_generation_prompt", param="continue_final_message")
