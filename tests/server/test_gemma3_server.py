"""Chat completions with image_url parts on a tiny Gemma 3 (its chat template walks content
parts and prints <start_of_image> per image): a data URL's image gives LLM.generate's tokens
for the rendered prompt and image (one image, two, text only), and LLM.chat's; a count that
does not match, <image_soft_token> typed in the text and an undecodable image are a 400
naming why, costing a concurrent request nothing and leaving no KV block behind."""

from __future__ import annotations

import base64
import threading

import httpx
import pytest

from flashpage import LLM, SamplingParams
from tests.gemma3_checkpoint import build_tiny_gemma3
from tests.llava_checkpoint import smooth_image
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import data_url

MAX_TOKENS = 6
LONG = {"max_model_len": 256}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3_server"))


@pytest.fixture(scope="module")
def server(gemma3_dir):
    with live_server(gemma3_dir, engine_kw=LONG) as s:  # room for pan-and-scan's crops
        yield s


@pytest.fixture(scope="module")
def offline(gemma3_dir):
    return LLM(str(gemma3_dir), **{**engine_kwargs(), **LONG})


def chat(server, messages, **kw) -> httpx.Response:
    body = {"model": server.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _msg(text: str, *images) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _rendered(text: str, n: int) -> str:
    return f"<s><start_of_turn>user\n{'<start_of_image>' * n}{text}<end_of_turn>\n<start_of_turn>model\n"


def _offline_text(offline: LLM, prompt: str, images) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = offline.get_tokenizer().encode(prompt, add_special_tokens=False)
    mm = {"multi_modal_data": {"image": list(images)}} if images else {}
    out = offline.generate({"prompt_token_ids": ids, **mm}, params, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0].text


def test_data_url_images_equal_generate(server, offline):
    a, b = smooth_image(60, 45, seed=1), smooth_image(50, 80, seed=2)
    for text, images in (("the quick brown fox", [a]), ("hello world", [a, b]), ("one two three", [])):
        r = chat(server, _msg(text, *images))
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"]
        assert got == _offline_text(offline, _rendered(text, len(images)), images), (text, len(images))
        ids = offline.get_tokenizer().encode(_rendered(text, len(images)), add_special_tokens=False)
        out = offline.generate({"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}}
                                                             if images else {})},
                               SamplingParams(max_tokens=1), use_tqdm=False)[0]
        # the expanded prompt's length (each image: 16 soft tokens, <end_of_image>, newlines)
        assert r.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
        assert len(out.prompt_token_ids) >= len(ids) + 17 * len(images)
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_llm_chat_takes_image_parts_as_the_server_does(server, offline):
    a = smooth_image(40, 70, seed=4)
    served = chat(server, _msg("what is it", a))
    assert served.status_code == 200, served.text
    out = offline.chat(_msg("what is it", a), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == served.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("messages, needles", [
    (lambda img: _msg("<start_of_image> what", img), ["2 <start_of_image> token(s)", "1 image(s)"]),
    (lambda img: _msg("<image_soft_token> what", img), ["holds <image_soft_token>"]),
    (lambda img: [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(b"not an image").decode()}}]}],
     ["could not be decoded"]),
])
def test_bad_requests_are_400_and_cost_nobody_anything(server, messages, needles):
    img = smooth_image(30, 30, seed=3)
    results: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: results.setdefault("good", chat(server, _msg("hello", img),
                                                                        max_tokens=24)))
    t.start()
    r = chat(server, messages(img))
    t.join(60)
    assert r.status_code == 400, r.text
    for n in needles:
        assert n in r.json()["error"]["message"], r.text
    assert results["good"].status_code == 200, results["good"].text
    assert len(results["good"].json()["choices"][0]["message"]["content"]) > 0 or \
        results["good"].json()["usage"]["completion_tokens"] == 24
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_pan_and_scan_per_request(server, offline):
    """A chat request's mm_processor_kwargs do_pan_and_scan: a wide image's crops in the
    prompt (usage counts them) and LLM.generate's text for the same kwargs; a bad value is a
    400 naming it."""
    kw = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
    img = smooth_image(40, 150, seed=5)
    r = chat(server, _msg("what is it", img), mm_processor_kwargs=kw)
    assert r.status_code == 200, r.text
    ids = offline.get_tokenizer().encode(_rendered("what is it", 1), add_special_tokens=False)
    out = offline.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [img]},
                            "mm_processor_kwargs": kw},
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert out.error is None, out.error
    assert r.json()["choices"][0]["message"]["content"] == out.outputs[0].text
    assert r.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    soft = offline.engine.mm_encoder.config.image_token_id
    assert out.prompt_token_ids.count(soft) == 5 * 16  # the whole image and 4 crops
    bad = chat(server, _msg("what is it", img), mm_processor_kwargs={"pan_and_scan_max_num_crops": -1})
    assert bad.status_code == 400 and "pan_and_scan_max_num_crops must be a positive int" in bad.text
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
