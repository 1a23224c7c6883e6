"""Tool calls through /v1/chat/completions (OpenAI's tools and tool_choice): the template
shown the tools and earlier calls, "auto" read back by the server's parser, "required" and
a named function forced by structured outputs (arguments valid against the tool's schema),
streamed and not; what a request cannot ask for is a 400 naming the field."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import LiveServer, live_server

jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = (
    "{% if tools %}<s>system: tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tool_model_dir(byte_model_dir, tmp_path_factory) -> Path:
    """The byte-level tiny model with a chat template that shows tools and earlier calls."""
    path = tmp_path_factory.mktemp("tiny_tools")
    shutil.copytree(byte_model_dir, path, dirs_exist_ok=True)
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(TEMPLATE)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if "chat_template" in cfg or not jinja.exists():
        cfg["chat_template"] = TEMPLATE
        cfg_file.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def tool_server(tool_model_dir) -> Iterator[LiveServer]:
    with live_server(tool_model_dir, engine_kw={"max_model_len": 512}, tool_call_parser="hermes",
                     enable_auto_tool_choice=True) as s:
        yield s


def _chat(server: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": server.model, "messages": MESSAGES, **body}, timeout=60)


def _stream(server: LiveServer, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": server.model, "messages": MESSAGES, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


OUR_ID = r"chatcmpl-tool-[0-9a-f]{24}"
ANY_ID = OUR_ID + r"|functions\.\w+:\d+"  # ours, or Kimi K2's own (vLLM's kimi_k2 keeps it)


def _check_call(call: dict, names=("get_weather", "get_time"), ids=OUR_ID) -> str:
    assert call["type"] == "function" and re.fullmatch(ids, call["id"]), call
    name = call["function"]["name"]
    assert name in names
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return name


def test_the_template_is_shown_tools_and_earlier_calls(tool_server):
    earlier = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(tool_server.url + "/tokenize", json={"messages": earlier, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(tool_server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert "system: tools: get_weather get_time" in text
    # the arguments as an object, as templates expect them (not the JSON text OpenAI sends)
    assert '"arguments": {"city": "Paris", "days": 3}' in text and "tool: sunny" in text


def test_auto_reads_the_models_calls(tool_server):
    # the answer forced to a hermes call by a guided choice; the server's parser reads it back
    r = _chat(tool_server, {"tools": TOOLS, "guided_choice": [CALL_TEXT], "max_tokens": 120})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    [call] = c["message"]["tool_calls"]
    assert _check_call(call) == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    # without a call the answer is content, as without tools
    plain = _chat(tool_server, {"tools": TOOLS, "guided_choice": ["It is sunny."], "max_tokens": 40}).json()
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["choices"][0]["finish_reason"] == "stop"


def _streamed(chunks: list[dict], choice: int = 0) -> tuple[str, list[dict], str | None]:
    """A choice's chunks read as a client reads them: (content, the calls with their argument
    pieces joined, finish reason). Checks vLLM's order: each call's first delta has its id,
    type and name, later ones only argument pieces; nothing after the finish reason."""
    content, calls, finish, pieces = "", [], None, 0
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] != choice:
                continue
            assert finish is None, f"a delta after the finish reason: {c}"
            d = c["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls", []):
                i, f = tc["index"], tc["function"]
                if i == len(calls):
                    assert tc["type"] == "function" and re.fullmatch(ANY_ID, tc["id"]), tc
                    calls.append({"id": tc["id"], "type": "function",
                                  "function": {"name": f["name"], "arguments": f["arguments"]}})
                else:
                    assert i < len(calls) and set(tc) == {"index", "function"} and set(f) == {"arguments"}, tc
                    calls[i]["function"]["arguments"] += f["arguments"]
                    pieces += 1
            finish = c["finish_reason"]
    if calls:
        assert pieces >= len(calls), "arguments streamed in pieces, not all with the name"
    return content, calls, finish


def _same_calls(streamed: list[dict], answered: list[dict]) -> None:
    assert [c["function"] for c in streamed] == [c["function"] for c in answered]


TWO_CALLS = ('Let me see. <tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":3}}</tool_call>\n'
             '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')


@pytest.mark.parametrize("text, content", [
    ("Let me see. " + CALL_TEXT, "Let me see. "),
    (TWO_CALLS, "Let me see. "),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>"),
])
def test_auto_streamed(tool_server, text, content):
    body = {"tools": TOOLS, "guided_choice": [text], "max_tokens": 200}
    answered = _chat(tool_server, body).json()["choices"][0]
    chunks = _stream(tool_server, body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    got, calls, finish = _streamed(chunks)
    assert got == content  # nothing of a call leaks out as content
    assert finish == answered["finish_reason"] == ("tool_calls" if calls else "stop")
    _same_calls(calls, answered["message"].get("tool_calls", []))
    for call in calls:
        _check_call(call)
    if calls:  # the first call's name went out before its arguments were all written
        first = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))
        assert first < len(chunks) - 5


def test_auto_streamed_with_the_openai_client(tool_server):
    """The official client's stream helper puts the pieces back together into the
    non-streamed message."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
              extra_body={"guided_choice": [TWO_CALLS]})
    answered = client.chat.completions.create(**kw).choices[0]
    argument_deltas = 0
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            argument_deltas += event.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion().choices[0]
    assert argument_deltas > 2
    assert final.finish_reason == answered.finish_reason == "tool_calls"
    assert [(c.id.startswith("chatcmpl-tool-"), c.function.name, c.function.arguments)
            for c in final.message.tool_calls] == [(True, c.function.name, c.function.arguments)
                                                   for c in answered.message.tool_calls]


OTHER_FORMATS = [  # --tool-call-parser, an answer calling get_weather(city="Paris", days=3) and get_time
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(zone=\'UTC\')]', ""),
    ("qwen3_coder", "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>", "Let me see.\n"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                  "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
                  "</parameter>\n</function>\n</tool_call>", ""),
    ("deepseek_v3", "Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me see."),
    ("deepseek_v31", "Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
                     '{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me see."),
    ("kimi_k2", "Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|>'
                "<|tool_calls_section_end|>", "Let me see."),
    ("glm45", "Let me see.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n"
              "<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>", "Let me see.\n"),
    ("internlm", 'Let me see.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris", '
                 '"days": 3}}<|action_end|><|action_start|><|plugin|>\n{"name": "get_time", "parameters": '
                 '{"zone": "UTC"}}<|action_end|>', "Let me see."),
    ("granite-20b-fc", 'Let me see.<function_call> {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
                       '\n<function_call> {"name": "get_time", "arguments": {"zone": "UTC"}}', "Let me see."),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                       '{"name": "get_time", "parameters": {"zone": "UTC"}}]', ""),
    ("hunyuan_a13b", 'Let me see.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                     '{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_calls>', "Let me see."),
    ("xlam", 'Let me see.\n```json\n[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
             '{"name": "get_time", "arguments": {"zone": "UTC"}}]\n```', "Let me see.\n"),
    ("seed_oss", "Let me see.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</seed:tool_call><seed:tool_call>\n"
                 "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</seed:tool_call>",
     "Let me see.\n"),    ("minimax", 'Let me see.<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
                '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_calls>', "Let me see."),
]
IDS = {"kimi_k2": r"functions\.get_(weather:0|time:1)"}  # the model's own ids (vLLM's kimi_k2)


@pytest.mark.parametrize("parser, text, content", OTHER_FORMATS)
def test_other_formats_through_the_server(tool_model_dir, parser, text, content):
    """vLLM's other --tool-call-parser names: the same calls read back, streamed and not
    (qwen3_coder's, qwen3_xml's and seed_oss' "3" an integer because the request's schema says
    days is one)."""
    with live_server(tool_model_dir, engine_kw={"max_model_len": 512}, tool_call_parser=parser,
                     enable_auto_tool_choice=True) as server:
        body = {"tools": TOOLS, "guided_choice": [text], "max_tokens": 300}
        answered = _chat(server, body).json()["choices"][0]
        assert answered["finish_reason"] == "tool_calls", answered
        calls = answered["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]
        for call in calls:
            _check_call(call, ids=IDS.get(parser, OUR_ID))
        got, streamed, finish = _streamed(_stream(server, body))
        assert got == content and finish == "tool_calls"
        _same_calls(streamed, calls)
        if parser in IDS:
            assert [c["id"] for c in streamed] == [c["id"] for c in calls]


@pytest.mark.parametrize("seed", range(3))
def test_named_function_is_forced(tool_server, seed):
    r = _chat(tool_server, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                            "temperature": 1.0, "seed": seed, "n": 2, "max_tokens": 60})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        [call] = c["message"]["tool_calls"]
        assert _check_call(call, names=("get_time",)) == "get_time"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_one_or_more_calls(tool_server, parallel):
    for seed in range(3):
        body = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed,
                "max_tokens": 200, "parallel_tool_calls": parallel}
        c = _chat(tool_server, body).json()["choices"][0]
        if c["finish_reason"] == "length":  # a random model may ramble past max_tokens
            continue
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            _check_call(call)



@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_streamed(tool_server, choice):
    """Streamed as "auto" streams: the pieces add up to the non-streamed answer's arguments
    for the same generation (an answer cut off by max_tokens is content, both ways)."""
    for seed in range(3):
        body = {"tools": TOOLS, "tool_choice": choice, "temperature": 1.0, "seed": seed, "max_tokens": 120}
        answered = _chat(tool_server, body).json()["choices"][0]
        content, calls, finish = _streamed(_stream(tool_server, body))
        assert finish == answered["finish_reason"]
        assert content == (answered["message"]["content"] or "")
        _same_calls(calls if finish == "tool_calls" else [], answered["message"].get("tool_calls", []))
        for call in calls if finish == "tool_calls" else []:
            _check_call(call)


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct names"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "shapes the output itself"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
])
def test_bad_tool_requests_are_named(tool_server, body, param, says):
    r = _chat(tool_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") and says in err["message"], err


def test_auto_needs_the_servers_parser(byte_model_dir):
    with live_server(byte_model_dir, engine_kw={"max_model_len": 512}) as plain:
        r = _chat(plain, {"tools": TOOLS})
        assert r.status_code == 400
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        # forcing a function needs no parser
        r = _chat(plain, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                          "max_tokens": 60})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]
    with pytest.raises(ValueError, match="unknown tool call parser"), \
            live_server(byte_model_dir, tool_call_parser="nope"):
        pass


def test_offline_chat_shows_the_template_tools(tool_model_dir):
    from flashpage import LLM

    llm = LLM(str(tool_model_dir), dtype="float32", device="cpu", max_model_len=512)
    with_tools = llm.chat_prompt_ids(MESSAGES, tools=TOOLS)
    assert "system: tools: get_weather get_time" in llm.engine.tokenizer.decode(with_tools)
    assert len(llm.chat_prompt_ids(MESSAGES)) < len(with_tools)


@pytest.mark.parametrize("parser, keeps", [("jamba", True), ("hermes", False)])
def test_a_format_of_special_tokens_keeps_them_in_the_text(tool_model_dir, parser, keeps):
    """jamba's <tool_calls> tags are special tokens: with tools its requests decode with
    skip_special_tokens off (as vLLM's parser asks); other formats keep the request's."""
    with live_server(tool_model_dir, engine_kw={"max_model_len": 512}, tool_call_parser=parser,
                     enable_auto_tool_choice=True) as s:
        engine = s.async_engine.engine
        seen = []
        add = engine.add_request

        def spy(*args, **kw):
            seen.append(args[2].skip_special_tokens)
            return add(*args, **kw)

        engine.add_request = spy
        try:
            r = _chat(s, {"tools": TOOLS, "max_tokens": 4})
        finally:
            del engine.add_request
        assert r.status_code == 200, r.text
        assert seen == [not keeps]
