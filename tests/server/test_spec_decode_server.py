"""A server with speculative decoding (--speculative-config): its completions are the
offline engine's tokens without drafts, streamed or not, and /metrics counts the drafts."""

from __future__ import annotations

import json

import httpx

from flashpage import SamplingParams
from tests.server.conftest import live_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def test_completions_with_drafts_equal_offline_without(tiny_model_dir, offline_llm):
    prompt = "the quick brown fox the quick brown fox the quick brown"
    want = offline_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with live_server(tiny_model_dir, engine_kw={"speculative_config": SPEC}) as s:
        assert s.async_engine.engine.proposer is not None  # type: ignore[attr-defined]
        r = httpx.post(s.url + "/v1/completions", json={"model": s.model, **body}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        text = ""
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"model": s.model, **body, "stream": True}) as st:
            for line in st.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert text == want.text
        m = s.wait_idle()
        assert m["flashpage:spec_decode_num_draft_tokens_total"] > 0
        assert m["flashpage:spec_decode_num_accepted_tokens_total"] <= \
            m["flashpage:spec_decode_num_draft_tokens_total"]
        assert m["flashpage:kv_cache_blocks_used"] == 0
