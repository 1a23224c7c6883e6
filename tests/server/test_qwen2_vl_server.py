"""Chat completions with image_url parts on a tiny Qwen2-VL (models/qwen2_vl.py): Qwen's
template puts <|vision_start|><|image_pad|><|vision_end|> where each part is, images of two
sizes give LLM.chat's tokens and the usage counts each image's own rows; a template that reads
a string gets the same three tokens as text; a video_url part that is no URL is a 400 naming
it (video files: tests/server/test_video_url_server.py); vLLM's per-request mm_processor_kwargs field
resizes the request's images (a bad one a 400 naming it)."""

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
        assert r.status_code == 400 and "video 0: its url must be a data URL" in r.text, r.text
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


def test_mm_processor_kwargs_field_per_request(tmp_path):
    """vLLM's mm_processor_kwargs in the chat request body: the images resized under the
    request's max_pixels (usage counts their rows), the answer LLM.chat's on an engine given
    it engine-wide; a request without it keeps the server's bounds; a key the processor does
    not read, a bad value, or a max_pixels above the server's is a 400 naming it (param
    mm_processor_kwargs), and the server still answers after, with no block held."""
    path = build_tiny_qwen2_vl(tmp_path / "qwen", "qwen2_vl")
    img = smooth_image(84, 112, seed=1)  # 12 rows at the tiny bounds, 2 under 56 x 56
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                         {"type": "text", "text": "the quick"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    small = LLM(str(path), **engine_kwargs(), mm_processor_kwargs={"max_pixels": 56 * 56})
    want_small = small.chat(msgs, params, use_tqdm=False)[0]
    want = LLM(str(path), **engine_kwargs()).chat(msgs, params, use_tqdm=False)[0]
    assert want_small.error is None and len(want_small.prompt_token_ids) == len(want.prompt_token_ids) - 10

    def post(server, kw) -> httpx.Response:
        body = {"model": server.model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0,
                **({"mm_processor_kwargs": kw} if kw is not None else {})}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    with live_server(path) as server:
        for kw, out in (({"max_pixels": 56 * 56}, want_small), (None, want), ({}, want)):
            r = post(server, kw)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == out.outputs[0].text
            assert r.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
        for kw, needle in (({"do_resize": False}, "read min_pixels, max_pixels, size and fps"),
                           ({"max_pixels": -5}, "max_pixels must be a positive int"),
                           ({"max_pixels": 28 * 28 * 48}, "above this engine's image max_pixels 18816")):
            r = post(server, kw)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert needle in err["message"] and err["param"] == "mm_processor_kwargs", err
        assert post(server, None).status_code == 200
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
