"""Chat completions with image_url parts on a tiny LLaVA-NeXT (server/images.py,
models/llava_next.py): images of two sizes give LLM.generate's tokens for the same prompt,
usage counts each image's own rows, and LLM.chat with the same parts gives the server's
tokens; a tensor for an image is refused by name."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.models.llava_next import anyres_pixels
from tests.llava_checkpoint import smooth_image
from tests.llava_next_checkpoint import build_tiny_llava_next
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import MAX_TOKENS, _msg, chat


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava_next_server"))


def test_image_urls_and_llm_chat_equal_generate(next_dir):
    wide, tall = smooth_image(20, 33, seed=1), smooth_image(45, 18, seed=2)
    kw = {"max_model_len": 256}  # two images' rows and the text
    llm = LLM(str(next_dir), **{**engine_kwargs(), **kw})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    vc = llm.engine.mm_encoder.config
    prompt = "USER: <image>\n<image>\nthe quick brown fox ASSISTANT:"
    ids = tok.encode(prompt, add_special_tokens=False)
    want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [wide, tall]}}, params,
                        use_tqdm=False)[0]
    assert want.error is None, want.error
    rows = [anyres_pixels(im, vc).rows for im in (wide, tall)]
    assert rows[0] != rows[1] and len(want.prompt_token_ids) == len(ids) - 2 + sum(rows)
    msgs = _msg("the quick brown fox", wide, tall)
    with live_server(next_dir, engine_kw=kw) as server:
        r = chat(server, msgs)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == want.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
    pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": wide},
                                        {"type": "image_pil", "image_pil": tall},
                                        {"type": "text", "text": "the quick brown fox"}]}]
    outs = llm.chat([msgs, pil, [{"role": "user", "content": "hello there"}]], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs[:2]] == [want.outputs[0].text] * 2
    assert outs[2].error is None


    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [wide, torch.zeros(3, 16, 16)]}},
                       params, use_tqdm=False)[0]
    assert "image 1: LLaVA-NeXT takes PIL images" in out.error
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_usable_blocks
