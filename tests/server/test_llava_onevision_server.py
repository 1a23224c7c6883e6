"""Chat completions with image_url parts on a tiny LLaVA-OneVision (server/images.py,
models/llava_onevision.py): one image (tiled, its grid pooled) and two (one tile each) give
LLM.generate's tokens for the same prompt, usage counting the rows the prompt's image count
makes; LLM.chat with the same parts gives the server's tokens."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from flashpage.models.llava_next import anyres_pixels
from tests.llava_checkpoint import smooth_image
from tests.llava_onevision_checkpoint import build_tiny_llava_onevision
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import MAX_TOKENS, _msg, chat


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    return build_tiny_llava_onevision(tmp_path_factory.mktemp("llava_ov_server"))


def test_image_urls_and_llm_chat_equal_generate(ov_dir):
    big, wide = smooth_image(45, 40, seed=1), smooth_image(20, 33, seed=2)
    kw = {"max_model_len": 256}
    llm = LLM(str(ov_dir), **{**engine_kwargs(), **kw})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    vc = llm.engine.mm_encoder.config
    cases = [((big,), "USER: <image>\nthe quick brown fox ASSISTANT:", anyres_pixels(big, vc).rows),
             ((big, wide), "USER: <image>\n<image>\nthe quick brown fox ASSISTANT:", 2 * 17)]
    wants = []
    for images, prompt, rows in cases:
        ids = tok.encode(prompt, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}}, params,
                            use_tqdm=False)[0]
        assert want.error is None, want.error
        assert len(want.prompt_token_ids) == len(ids) - len(images) + rows
        wants.append(want)
    with live_server(ov_dir, engine_kw=kw) as server:
        for (images, _, _), want in zip(cases, wants, strict=True):
            r = chat(server, _msg("the quick brown fox", *images))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == want.outputs[0].text
            assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
    outs = llm.chat([_msg("the quick brown fox", *images) for images, _, _ in cases], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [w.outputs[0].text for w in wants]
