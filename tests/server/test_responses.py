"""POST /v1/responses (server/responses.py): OpenAI's Responses API over the chat endpoint,
through the official client: the same text as chat, streamed events that add up to it,
function calls as output items, text.format, and named 400s."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import live_server
from tests.server.test_errors import assert_error, post
from tests.server.test_tools import tool_model_dir  # noqa: F401 (a fixture)

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                       "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def test_text_equals_chat(client):
    r = client.responses.create(model="tiny", input="hello there", max_output_tokens=6, temperature=0,
                                instructions="Be brief.")
    text, finish, usage = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hello there"}], 6)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text and r.output[0].type == "message"
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    # input items: a message list with text parts
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]
    again = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0,
                                    instructions="Be brief.")
    assert again.output_text == text


def test_streamed_events_add_up(client):
    kw = dict(model="tiny", input="the quick brown fox", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


@pytest.fixture(scope="module")
def tool_server(tool_model_dir):  # noqa: F811
    with live_server(tool_model_dir, engine_kw={"max_model_len": 512}, tool_call_parser="hermes",
                     enable_auto_tool_choice=True) as s:
        yield s


def test_function_calls_are_output_items(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", input="Weather in Paris?", tools=[TOOL], max_output_tokens=60,
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"city"}
    events = list(client.responses.create(stream=True, **kw))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == pieces == calls[0].arguments
    # the call and its output sent back as input items
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    again = client.responses.create(model="tiny", input=follow, tools=[TOOL], max_output_tokens=4)
    assert again.status in ("completed", "incomplete")


def test_text_format_json_object(byte_model_dir):
    with live_server(byte_model_dir) as s:
        r = post(s, "/v1/responses", {"input": "give JSON", "max_output_tokens": 80, "temperature": 0,
                                      "text": {"format": {"type": "json_object"}}})
        out = r.json()
        assert r.status_code == 200 and out["text"]["format"] == {"type": "json_object"}
        if out["status"] == "completed":
            assert isinstance(json.loads(out["output"][0]["content"][0]["text"]), dict)


@pytest.mark.parametrize("body, param, needle", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "functions only"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text", "not supported"),
    ({"input": []}, "input", "empty"),
])
def test_what_is_refused(server, body, param, needle):
    assert_error(post(server, "/v1/responses", body), 400, needle, param=param)


def test_stored_responses_continue_a_conversation(client, server):
    """previous_response_id: the earlier input and output before the new input (chat's prompt
    for the same messages); GET answers a stored response again, DELETE forgets it; store
    false keeps nothing; an unknown id is a 404."""
    first = client.responses.create(model="tiny", input="hello there", max_output_tokens=4,
                                    temperature=0, instructions="Be brief.")
    second = client.responses.create(model="tiny", input="and then?", max_output_tokens=4,
                                     temperature=0, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    messages = [{"role": "user", "content": "hello there"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then?"}]  # instructions are not carried over
    text, _, usage = _chat_text(client, messages, 4)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    again = client.responses.retrieve(first.id)
    assert again.output_text == first.output_text and again.id == first.id
    streamed = list(client.responses.create(model="tiny", input="and then?", max_output_tokens=4,
                                            temperature=0, previous_response_id=first.id, stream=True))
    assert streamed[-1].response.output_text == text
    assert client.responses.retrieve(streamed[-1].response.id).output_text == text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    kept_out = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    assert kept_out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_out.id)
    assert_error(post(server, "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}),
                 404, "not found", param="previous_response_id")
