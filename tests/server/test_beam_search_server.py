"""use_beam_search on /v1/completions and /v1/chat/completions (server/beam.py): the n
choices are LLM.beam_search's n beams, best first; what a beam cannot honour is a 400."""

from __future__ import annotations

import pytest

from flashpage import BeamSearchParams
from tests.server.test_errors import assert_error, post

PROMPT = "the quick brown fox"


def test_completion_choices_are_the_offline_beams(server, offline_llm):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "n": 3,
                                         "use_beam_search": True, "length_penalty": 0.5,
                                         "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    want = offline_llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=5,
                                                            length_penalty=0.5))[0].sequences
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [s.text for s in want]
    assert [c["finish_reason"] for c in body["choices"]] == [s.finish_reason for s in want]
    n_prompt = len(offline_llm.engine.tokenize(PROMPT))
    for c, s in zip(body["choices"], want, strict=True):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(s.tokens) - n_prompt  # one entry per generated token
        assert sum(lp["token_logprobs"]) == pytest.approx(s.cum_logprob, abs=1e-4)
        # the 2 likeliest alternatives (and the token itself where it is not one of them)
        assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"]), lp["top_logprobs"]
    gen = sum(len(s.tokens) for s in want) - 3 * n_prompt
    assert body["usage"]["completion_tokens"] == gen
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_chat_beams(server, offline_llm):
    msgs = [{"role": "user", "content": "hello"}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "n": 2,
                                              "use_beam_search": True})
    assert r.status_code == 200, r.text
    ids = offline_llm.chat_prompt_ids(msgs)
    want = offline_llm.beam_search({"prompt_token_ids": ids},
                                   BeamSearchParams(beam_width=2, max_tokens=4))[0].sequences
    assert [c["message"]["content"] for c in r.json()["choices"]] == [s.text for s in want]


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"stop": ["x"]}, "stop"),
    ({"echo": True}, "echo"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"n": 11}, "n"),
])
def test_what_beams_cannot_take_is_a_400(server, extra, param):
    body = {"prompt": PROMPT, "max_tokens": 3, "use_beam_search": True, **extra}
    assert_error(post(server, "/v1/completions", body), 400, param=param)
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
