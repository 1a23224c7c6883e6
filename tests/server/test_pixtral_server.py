"""Chat completions with image_url parts on a tiny Mistral3 (a Pixtral tower): Mistral's
template loops over content blocks, each image part its [IMG], which the engine expands to
the image's rows of [IMG] ... [IMG_BREAK] ... [IMG_END]; the same text as LLM.generate on
the rendered prompt with the same images, and no KV block left behind."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from flashpage import LLM, SamplingParams
from tests.llava_checkpoint import smooth_image
from tests.pixtral_checkpoint import build_tiny_pixtral
from tests.server.conftest import engine_kwargs, live_server

MAX_TOKENS = 6


def _url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory):
    return build_tiny_pixtral(tmp_path_factory.mktemp("mistral3_server"))


def test_image_url_parts_equal_generate(mistral3_dir):
    a, b = smooth_image(30, 44, seed=1), smooth_image(12, 31, seed=2)
    offline = LLM(str(mistral3_dir), **engine_kwargs())
    tok = offline.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "the quick"}, {"type": "image"}]}], tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    want = offline.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [a, b]}},
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert want.error is None, want.error
    with live_server(mistral3_dir) as server:
        body = {"model": server.model, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(a)}},
                                         {"type": "text", "text": "the quick"},
                                         {"type": "image_url", "image_url": {"url": _url(b)}}]}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        body["messages"][0]["content"].pop()  # two [IMG] in the template's text, one image
        body["messages"][0]["content"].append({"type": "text", "text": " [IMG]"})
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "2 image token(s)" in r.text, r.text
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
