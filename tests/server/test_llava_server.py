"""Chat completions with image_url parts (server/images.py) on a tiny LLaVA: a data URL's
image gives LLM.generate's tokens for the same prompt and image, whether the chat template
loops over content parts (llava-hf's) or reads a string (the placeholder then goes in as
text), as an http URL's or a file:// URL's under --allowed-local-media-path; URLs that
cannot be read, broken data URLs and undecodable bytes are a 400 naming why, leaving no
request or KV block behind and costing a concurrent request nothing."""

from __future__ import annotations

import base64
import io
import shutil
import threading

import httpx
import pytest

from flashpage import LLM, SamplingParams
from tests.llava_checkpoint import build_tiny_llava, smooth_image
from tests.server.conftest import CHAT_TEMPLATE, engine_kwargs, live_server

MAX_TOKENS = 6


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava_server"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """A folder file:// URLs may name (the server's --allowed-local-media-path), served over
    http on 127.0.0.1 too: (folder, its http URL)."""
    import functools
    import http.server

    folder = tmp_path_factory.mktemp("media")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{web.server_address[1]}"
    web.shutdown()


@pytest.fixture(scope="module")
def llava_server(llava_dir, media_dir):
    with live_server(llava_dir, engine_kw={"allowed_local_media_path": str(media_dir[0])}) as s:
        yield s


@pytest.fixture(scope="module")
def offline(llava_dir):
    return LLM(str(llava_dir), **engine_kwargs())


def chat(server, messages, **kw) -> httpx.Response:
    body = {"model": server.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _msg(text: str, *images) -> list[dict]:
    """One user message: each image an image_url part (a data URL), each dict a content part
    as given (a video_url), then the text."""
    parts = [im if isinstance(im, dict) else {"type": "image_url", "image_url": {"url": data_url(im)}}
             for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def assert_served_as(model_dir, engine_kw: dict, cases, wants, too_long, max_model_len: int) -> None:
    """A live server over ``model_dir`` answers each case's images (or content parts: _msg)
    (with "the quick brown fox") as ``wants`` (LLM.generate's outputs), its usage their expanded prompt lengths; the
    images ``too_long`` make a prompt refused (400) by its length before it runs; no KV
    block stays held."""
    with live_server(model_dir, engine_kw=engine_kw) as server:
        for images, want in zip(cases, wants, strict=True):
            r = chat(server, _msg("the quick brown fox", *images))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == want.outputs[0].text
            assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        r = chat(server, _msg("the quick brown fox", *too_long))
        assert r.status_code == 400 and str(max_model_len) in r.text, r.text
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def assert_sampled_as(llm: LLM, model_dir, engine_kw: dict, video_url: str, sample: dict, want,
                      bad_sample: dict, why: str) -> None:
    """A chat with one ``video_url`` part under the request's ``mm_processor_kwargs``
    ``sample`` (a video processor's frame sampling) gives ``want`` (LLM.generate's output on
    the frames it picks) through LLM.chat and a live server over ``model_dir`` (usage its
    prompt length); ``bad_sample`` is a 400 whose body holds ``why``; no KV block stays held."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    clip = _msg("the quick brown fox", {"type": "video_url", "video_url": {"url": video_url}})
    got = llm.chat(clip, params, use_tqdm=False, mm_processor_kwargs=sample)[0]
    assert got.prompt_token_ids == want.prompt_token_ids and got.outputs[0].token_ids == want.outputs[0].token_ids
    with live_server(model_dir, engine_kw=engine_kw) as server:
        r = chat(server, clip, mm_processor_kwargs=sample)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        r = chat(server, clip, mm_processor_kwargs=bad_sample)
        assert r.status_code == 400 and why in r.text, r.text
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def _offline_text(offline: LLM, prompt: str, images) -> str:
    """LLM.generate's text for ``prompt`` as the chat template renders it (tokenized without
    the tokenizer's BOS, as apply_chat_template tokenizes) and ``images``."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = offline.get_tokenizer().encode(prompt, add_special_tokens=False)
    out = offline.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}},
                           params, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0].text


def test_data_url_image_equals_generate(llava_server, offline):
    """llava-hf's template ("USER: <image>\\n<text> ASSISTANT:"): the same tokens as
    LLM.generate on that prompt with the same image; two images; JPEG too."""
    a, b = smooth_image(40, 30, seed=1), smooth_image(33, 52, seed=2)
    r = chat(llava_server, _msg("the quick brown fox", a))
    assert r.status_code == 200, r.text
    body = r.json()
    want = _offline_text(offline, "USER: <image>\nthe quick brown fox ASSISTANT:", [a])
    assert body["choices"][0]["message"]["content"] == want
    tok = offline.get_tokenizer()
    prompt_ids = tok.encode("USER: <image>\nthe quick brown fox ASSISTANT:", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) + 15  # the image's 16 rows
    r = chat(llava_server, _msg("hello world", a, b))
    assert r.status_code == 200, r.text
    want = _offline_text(offline, "USER: <image>\n<image>\nhello world ASSISTANT:", [a, b])
    assert r.json()["choices"][0]["message"]["content"] == want
    # a JPEG decodes to other pixels than the PNG: compare with that decoding
    from PIL import Image

    jpeg = data_url(a, "JPEG")
    decoded = Image.open(io.BytesIO(base64.b64decode(jpeg.split(",", 1)[1])))
    r = chat(llava_server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": jpeg}},
                                                        {"type": "text", "text": "hello"}]}])
    assert r.status_code == 200, r.text
    want = _offline_text(offline, "USER: <image>\nhello ASSISTANT:", [decoded])
    assert r.json()["choices"][0]["message"]["content"] == want
    assert llava_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_string_template_gets_the_placeholder_text(llava_dir, tmp_path):
    """A template that reads content as a string: the placeholder text before the text."""
    path = tmp_path / "string_template"
    shutil.copytree(llava_dir, path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    img = smooth_image(36, 36, seed=5)
    with live_server(path) as server:
        r = chat(server, _msg("one two three", img))
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"]
    llm = LLM(str(path), **engine_kwargs())
    assert got == _offline_text(llm, "<s>user: <image>\none two three </s><s>assistant:", [img])


@pytest.mark.parametrize("url, needles", [
    ("http://127.0.0.1:1/cat.png", ["image 0: fetching", "failed"]),
    ("file:///etc/passwd", ["is not under allowed_local_media_path"]),
    ("ftp://example.com/cat.png", ["an http(s) URL or a file:// URL"]),
    ("data:image/png;base64,@@@not base64@@@", ["not valid base64"]),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), ["could not be decoded"]),
])
def test_bad_image_urls_are_400_and_cost_nobody_anything(llava_server, url, needles):
    img = smooth_image(30, 30, seed=3)
    results: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: results.setdefault("good", chat(llava_server, _msg("hello", img),
                                                                        max_tokens=24)))
    t.start()
    r = chat(llava_server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": "hi"}]}])
    t.join(60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages"
    for n in needles:
        assert n in err["message"], err["message"]
    assert results["good"].status_code == 200, results["good"].text
    assert llava_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_count_mismatch_and_beam_search_are_400(llava_server):
    img = smooth_image(30, 30, seed=3)
    # the placeholder typed into the text as well: two image tokens for one image
    r = chat(llava_server, _msg("<image> what is this", img))
    assert r.status_code == 400 and "2 image token(s)" in r.json()["error"]["message"], r.text
    r = chat(llava_server, _msg("hi", img), use_beam_search=True, n=2)
    assert r.status_code == 400 and "use_beam_search with images" in r.json()["error"]["message"], r.text
    assert llava_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_text_only_chat_on_a_parts_template(llava_server, offline):
    """llava-hf's template walks content parts: a text-only message (string content) is
    given to it as one text part, so its text is not lost (server and LLM.chat)."""
    r = chat(llava_server, [{"role": "user", "content": "one two three"}])
    assert r.status_code == 200, r.text
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = offline.get_tokenizer().encode("USER: one two three ASSISTANT:", add_special_tokens=False)
    want = offline.generate([ids], params, use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert offline.chat([{"role": "user", "content": "one two three"}], params,
                        use_tqdm=False)[0].outputs[0].text == want


def test_llm_chat_takes_image_parts_as_the_server_does(llava_server, offline):
    """LLM.chat with image parts (a data URL, vLLM's image_pil): the server's tokens for the
    same messages; a batch mixing them with a text-only conversation; bad parts named."""
    a, b = smooth_image(40, 30, seed=1), smooth_image(33, 52, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    msgs = _msg("the quick brown fox", a, b)
    served = chat(llava_server, msgs)
    assert served.status_code == 200, served.text
    pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a},
                                        {"type": "image_pil", "image_pil": b},
                                        {"type": "text", "text": "the quick brown fox"}]}]
    text_only = [{"role": "user", "content": "hello there"}]
    outs = offline.chat([msgs, pil, text_only], params, use_tqdm=False)
    want = served.json()["choices"][0]["message"]["content"]
    assert [o.outputs[0].text for o in outs[:2]] == [want, want]
    plain = chat(llava_server, text_only)
    assert outs[2].outputs[0].text == plain.json()["choices"][0]["message"]["content"]
    with pytest.raises(ValueError, match="file:// URLs are read only under allowed_local_media_path"):
        offline.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}], params)
    with pytest.raises(ValueError, match="audio content parts given, but this model takes no audio input"):
        offline.chat([{"role": "user", "content": [{"type": "input_audio"}]}], params)
    with pytest.raises(ValueError, match="content part 0 has type 'file'"):
        offline.chat([{"role": "user", "content": [{"type": "file"}]}], params)
    assert offline.engine.kv_manager.num_free_blocks == offline.engine.kv_manager.num_usable_blocks


def test_http_and_file_urls_give_the_data_urls_tokens(llava_server, media_dir):
    """The same image as a data URL, an http URL and a file:// URL under the server's
    --allowed-local-media-path: the same answer."""
    folder, web = media_dir
    img = smooth_image(34, 41, seed=8)
    img.save(folder / "cat.png")
    answers = []
    for url in (data_url(img), f"{web}/cat.png", f"file://{folder}/cat.png"):
        r = chat(llava_server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                             {"type": "text", "text": "what is it"}]}])
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] == answers[2]
    r = chat(llava_server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{web}/none.png"}}]}])
    assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"], r.text
    assert llava_server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
