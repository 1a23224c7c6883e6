"""Chat completions with image_url parts on a tiny SmolVLM (server/images.py,
models/idefics3.py): one image (a grid of tiles and the global one) and two give
LLM.generate's tokens for the prompt SmolVLM's chat template renders (an <image> per image
part), usage counting each image's expanded prompt tokens; an over-long prompt is refused by
its length; LLM.chat with the same parts gives the server's tokens."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from tests.idefics3_checkpoint import build_tiny_idefics3
from tests.llava_checkpoint import smooth_image
from tests.server.conftest import engine_kwargs
from tests.server.test_llava_server import MAX_TOKENS, _msg, assert_served_as


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    return build_tiny_idefics3(tmp_path_factory.mktemp("smolvlm_server"), smolvlm=True)


def test_image_urls_and_llm_chat_equal_generate(smolvlm_dir):
    wide, tall = smooth_image(20, 40, seed=1), smooth_image(45, 12, seed=2)
    kw = {"max_model_len": 320}
    llm = LLM(str(smolvlm_dir), **{**engine_kwargs(), **kw})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    enc = llm.engine.mm_encoder
    cases = [(wide,), (wide, tall)]
    wants = []
    for images in cases:
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": "the quick brown fox"}]
        prompt = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
        assert prompt.count("<image>") == len(images)
        ids = tok.encode(prompt, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}}, params,
                            use_tqdm=False)[0]
        assert want.error is None, want.error
        assert len(want.prompt_token_ids) == len(ids) + sum(r - 1 for r in enc.rows_of(list(images)))
        wants.append(want)
    # a prompt too long once its images are expanded: refused before it runs, by its length
    assert_served_as(smolvlm_dir, kw, cases, wants, [smooth_image(30, 30, seed=3)] * 2, 320)
    outs = llm.chat([_msg("the quick brown fox", *images) for images in cases], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [w.outputs[0].text for w in wants]
