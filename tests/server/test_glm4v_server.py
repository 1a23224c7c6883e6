"""Chat completions with image_url parts on a tiny GLM-4.1V (models/glm4v.py): images of two
sizes give LLM.chat's text, and the usage counts each image's own rows."""

from __future__ import annotations

import httpx

from flashpage import LLM, SamplingParams
from tests.glm4v_checkpoint import shared_glm4v_path
from tests.llava_checkpoint import smooth_image
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import data_url

MAX_TOKENS = 6


def test_image_urls_equal_llm_chat_and_count_each_images_rows(tmp_path_factory):
    path = shared_glm4v_path(tmp_path_factory)
    a, b = smooth_image(84, 130, seed=1), smooth_image(100, 40, seed=2)  # 15 and 4 rows
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the quick"},
                                         {"type": "image_url", "image_url": {"url": data_url(a)}},
                                         {"type": "text", "text": "brown fox"},
                                         {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = LLM(str(path), **engine_kwargs())
    want = offline.chat(msgs, params, use_tqdm=False)[0]
    enc = offline.engine.mm_encoder
    assert want.error is None and want.prompt_token_ids.count(enc.config.image_token_id) == 19
    assert want.prompt_token_ids.count(enc.config.vision_start_token_id) == 2  # <|begin_of_image|>
    with live_server(path) as server:
        body = {"model": server.model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
