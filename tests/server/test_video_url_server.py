"""Chat completions with video_url parts on a tiny Qwen2.5-VL (server/images.py,
engine/video_io.py): a file:// video (sampled as --media-io-kwargs says) and the same file as a
data URL answer as LLM.chat does offline, the usage counting the video's rows; a video beside
an image; bad videos (no video, empty, over the byte cap, outside the allowed folder, a host
not allowed, an image data URL) sent together with a good request are 400s naming the video
(param messages) while the good one keeps its answer, and no KV block stays held; a "video"
part of frames is a 400 pointing at video_url."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import pytest

from flashpage import LLM, SamplingParams
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import data_url
from tests.video_files import encode, pattern_frames

pytest.importorskip("av")

MAX_TOKENS = 6
IO = {"video": {"num_frames": 4}}


def _post(server, content: list[dict]) -> httpx.Response:
    body = {"model": server.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_video_urls_answer_as_llm_chat_and_bad_ones_are_named(tmp_path, monkeypatch):
    path = build_tiny_qwen2_vl(tmp_path / "qwen", "qwen2_5_vl")
    root = tmp_path / "media"
    root.mkdir()
    raw = encode(pattern_frames(12, 56, 84, seed=7), rate=6)
    (root / "clip.mkv").write_bytes(raw)
    (root / "notes.mkv").write_bytes(b"not a video " * 30)
    (root / "empty.mkv").write_bytes(b"")
    (tmp_path / "outside.mkv").write_bytes(raw)
    kw = {"allowed_local_media_path": str(root), "allowed_media_domains": ["127.0.0.1"], "media_io_kwargs": IO}
    img = smooth_image(84, 112, seed=1)
    good = [{"type": "text", "text": "watch"}, _video(f"file://{root}/clip.mkv")]
    mixed = [_video("data:video/x-matroska;base64," + base64.b64encode(raw).decode()),
             {"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": "and"}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = LLM(str(path), **engine_kwargs(), **kw)
    want = [offline.chat([{"role": "user", "content": c}], params, use_tqdm=False)[0] for c in (good, mixed)]
    assert all(w.error is None for w in want)
    vpad = offline.engine.mm_encoder.config.video_token_id
    assert want[0].prompt_token_ids.count(vpad) > 1  # the video's rows counted in the usage below
    bad = [
        ([_video(f"file://{root}/notes.mkv")], "video 0 could not be decoded"),
        ([_video(f"file://{root}/clip.mkv"), _video(f"file://{root}/empty.mkv")], "video 1 is empty (0 bytes)"),
        ([_video(f"file://{root}/../outside.mkv")], "is not under allowed_local_media_path"),
        ([_video("https://blocked.invalid/a.mp4")], "host 'blocked.invalid' is not in allowed_media_domains"),
        ([_video(data_url(img))], "of type 'image/png' given as a video"),
    ]
    with live_server(path, engine_kw=kw) as server:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            oks = [pool.submit(_post, server, c) for c in (good, mixed)]
            errs = [pool.submit(_post, server, c) for c, _ in bad]
            for f, w in zip(oks, want, strict=True):
                r = f.result()
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == w.outputs[0].text
                assert r.json()["usage"]["prompt_tokens"] == len(w.prompt_token_ids)
            for f, (_, needle) in zip(errs, bad, strict=True):
                r = f.result()
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert needle in err["message"] and err["param"] == "messages", err
        monkeypatch.setenv("FLASHPAGE_VIDEO_MAX_BYTES", "100")
        r = _post(server, good)
        assert r.status_code == 400 and "more than 100 bytes (FLASHPAGE_VIDEO_MAX_BYTES)" in r.text, r.text
        monkeypatch.delenv("FLASHPAGE_VIDEO_MAX_BYTES")
        r = _post(server, [{"type": "video", "video": ["data:image/png;base64,AAAA"]}])
        assert r.status_code == 400 and "video_url" in r.json()["error"]["message"], r.text
        r = _post(server, good)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want[0].outputs[0].text
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_internvl_video_url_answers_as_llm_chat(tmp_path):
    """InternVL: the template's <video> for a video_url part is written out as each sampled
    frame's "FrameN: <img>...</img>" text before tokenizing (as LLM.chat does), so the server's
    answer and prompt token count are LLM.chat's; a video beside an image too."""
    from tests.internvl_checkpoint import build_tiny_internvl

    path = build_tiny_internvl(tmp_path / "ivl")
    root = tmp_path / "media"
    root.mkdir()
    (root / "clip.mkv").write_bytes(encode(pattern_frames(12, 56, 84, seed=7), rate=6))
    kw = {"allowed_local_media_path": str(root), "media_io_kwargs": IO, "max_model_len": 1024}
    img = smooth_image(40, 30, seed=2)
    convs = [[{"type": "text", "text": "watch"}, _video(f"file://{root}/clip.mkv")],
             [{"type": "image_url", "image_url": {"url": data_url(img)}}, _video(f"file://{root}/clip.mkv"),
              {"type": "text", "text": "and"}]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = LLM(str(path), **{**engine_kwargs(), **kw})
    want = [offline.chat([{"role": "user", "content": c}], params, use_tqdm=False)[0] for c in convs]
    assert all(w.error is None for w in want)
    ctx = offline.engine.mm_encoder.config.image_token_id
    assert want[0].prompt_token_ids.count(ctx) > 0
    with live_server(path, engine_kw=kw) as server:
        for c, w in zip(convs, want, strict=True):
            r = _post(server, c)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == w.outputs[0].text
            assert r.json()["usage"]["prompt_tokens"] == len(w.prompt_token_ids)
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
