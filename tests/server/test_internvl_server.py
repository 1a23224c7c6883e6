"""Chat completions with image_url parts on a tiny InternVL (server/images.py,
models/internvl.py): one image (a grid of tiles and its thumbnail) and two give
LLM.generate's tokens for the prompt InternVL's chat template renders (an <IMG_CONTEXT> line
per image part), usage counting each image's rows and its <img> / </img>; LLM.chat with the
same parts gives the server's tokens."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from flashpage.models.internvl import tile_image
from tests.internvl_checkpoint import build_tiny_internvl
from tests.llava_checkpoint import smooth_image
from tests.server.conftest import engine_kwargs
from tests.server.test_llava_server import MAX_TOKENS, _msg, assert_served_as


@pytest.fixture(scope="module")
def ivl_dir(tmp_path_factory):
    return build_tiny_internvl(tmp_path_factory.mktemp("internvl_server"))


def test_image_urls_and_llm_chat_equal_generate(ivl_dir):
    square, wide = smooth_image(33, 33, seed=1), smooth_image(20, 40, seed=2)
    kw = {"max_model_len": 256}
    llm = LLM(str(ivl_dir), **{**engine_kwargs(), **kw})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    vc = llm.engine.mm_encoder.config
    cases = [(square,), (square, wide)]
    wants = []
    for images in cases:
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": "the quick brown fox"}]
        prompt = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
        assert prompt.count("<IMG_CONTEXT>\n") == len(images)
        ids = tok.encode(prompt, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}}, params,
                            use_tqdm=False)[0]
        assert want.error is None, want.error
        rows = sum(tile_image(im, vc).rows for im in images)
        assert len(want.prompt_token_ids) == len(ids) + rows + len(images)  # <img>, </img> for each placeholder
        wants.append(want)
    # a prompt too long once its images are expanded: refused before it runs, by its length
    assert_served_as(ivl_dir, kw, cases, wants, [smooth_image(10, 90, seed=3)] * 3, 256)
    outs = llm.chat([_msg("the quick brown fox", *images) for images in cases], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [w.outputs[0].text for w in wants]
