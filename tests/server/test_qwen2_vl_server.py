"""Chat completions with image_url parts on a tiny Qwen2-VL (models/qwen2_vl.py): Qwen's
template puts <|vision_start|><|image_pad|><|vision_end|> where each part is, images of two
sizes give LLM.chat's tokens and the usage counts each image's own rows; a template that reads
a string gets the same three tokens as text; a video part is a 400 naming the missing
decoder and the offline ways to give frames."""

from __future__ import annotations

import shutil

import httpx

from flashpage import LLM, SamplingParams
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl
from tests.server.conftest import CHAT_TEMPLATE, engine_kwargs, live_server
from tests.server.test_llava_server import data_url

MAX_TOKENS = 6


def _chat(server, messages) -> httpx.Response:
    body = {"model": server.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def test_image_urls_equal_llm_chat_and_count_each_images_rows(tmp_path):
    path = build_tiny_qwen2_vl(tmp_path / "qwen", "qwen2_vl")
    a, b = smooth_image(84, 112, seed=1), smooth_image(100, 40, seed=2)  # 12 and 4 rows
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the quick"},
                                         {"type": "image_url", "image_url": {"url": data_url(a)}},
                                         {"type": "text", "text": "brown fox"},
                                         {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = LLM(str(path), **engine_kwargs())
    want = offline.chat(msgs, params, use_tqdm=False)[0]
    assert want.error is None and want.prompt_token_ids.count(offline.engine.mm_encoder.config.image_token_id) == 16
    with live_server(path) as server:
        r = _chat(server, msgs)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]
        r = _chat(server, video)
        assert r.status_code == 400 and "video decoder" in r.text and "multi_modal_data" in r.text, r.text
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0

    # a template that prints content as a string: the three tokens as text, before the text
    string = tmp_path / "string"
    shutil.copytree(path, string)
    (string / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with live_server(string) as server:
        r = _chat(server, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(b)}}, {"type": "text", "text": "one two"}]}])
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"]
    llm = LLM(str(string), **engine_kwargs())
    tok = llm.get_tokenizer()
    ids = tok.encode("<s>user: <|vision_start|><|image_pad|><|vision_end|>\none two </s><s>assistant:",
                     add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [b]}}, params, use_tqdm=False)[0]
    assert got == out.outputs[0].text
