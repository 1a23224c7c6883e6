"""Chat completions with image_url parts on a tiny GLM-4.1V (models/glm4v.py): images of two
sizes give LLM.chat's text, and the usage counts each image's own rows. Its video_url parts
(a file:// video and the same file as a data URL beside an image, engine/video_io.py
sampling it as --media-io-kwargs says) give LLM.generate's tokens for the prompt GLM's chat
template renders with the decoded (frames, metadata) pair (each frame group's rows and time
written in place of its <|video|>), usage counting them, and LLM.chat's; two videos too long
are refused by their length. A request's mm_processor_kwargs asking Glm4vVideoProcessor's
do_sample_frames (models/glm4v_video.py) gives LLM.generate's tokens on the frames it picks,
through LLM.chat and the server; picks the decoded frames lack are a 400 naming them."""

from __future__ import annotations

import base64

import httpx
import pytest

from flashpage import LLM, SamplingParams
from tests.glm4v_checkpoint import shared_glm4v_path
from tests.llava_checkpoint import smooth_image
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import (
    MAX_TOKENS,
    _msg,
    assert_sampled_as,
    assert_served_as,
    data_url,
)


def test_image_urls_equal_llm_chat_and_count_each_images_rows(tmp_path_factory):
    path = shared_glm4v_path(tmp_path_factory)
    a, b = smooth_image(84, 130, seed=1), smooth_image(100, 40, seed=2)  # 15 and 4 rows
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the quick"},
                                         {"type": "image_url", "image_url": {"url": data_url(a)}},
                                         {"type": "text", "text": "brown fox"},
                                         {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = LLM(str(path), **engine_kwargs())
    want = offline.chat(msgs, params, use_tqdm=False)[0]
    enc = offline.engine.mm_encoder
    assert want.error is None and want.prompt_token_ids.count(enc.config.image_token_id) == 19
    assert want.prompt_token_ids.count(enc.config.vision_start_token_id) == 2  # <|begin_of_image|>
    with live_server(path) as server:
        body = {"model": server.model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


@pytest.fixture(scope="module")
def glm_video(tmp_path_factory):
    """The tiny GLM-4.1V, a folder file:// URLs may name holding clip.mkv (6 frames of 56 x 84,
    2 a second), its bytes, the engine's settings (the file sampled to 4 frames,
    --media-io-kwargs; a video and an image fit max_model_len, two videos do not) and an
    offline LLM with them."""
    pytest.importorskip("av")
    from tests.video_files import encode, pattern_frames

    path = shared_glm4v_path(tmp_path_factory)
    root = tmp_path_factory.mktemp("glm4v_media")
    raw = encode(pattern_frames(6, 56, 84, seed=7), rate=2)
    (root / "clip.mkv").write_bytes(raw)
    kw = {"allowed_local_media_path": str(root), "media_io_kwargs": {"video": {"num_frames": 4}},
          "max_model_len": 56}
    return path, root, raw, kw, LLM(str(path), **{**engine_kwargs(), **kw})


def _rendered_ids(tok, kinds: list[str]) -> list[int]:
    """GLM's chat template on one user message: these media parts, then the text, tokenized
    as the server tokenizes it."""
    parts = [{"type": k} for k in kinds] + [{"type": "text", "text": "the quick brown fox"}]
    return list(tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def test_video_urls_equal_generate_and_llm_chat(glm_video):
    """A file:// video_url, and the same file as a data URL beside an image, answer as
    LLM.generate on the decoded pair (frames 0, 1 | 3, 5 of the file: two frame groups of 6
    rows, at 0 and 1 s); two videos are refused by their length; LLM.chat gives the same."""
    from flashpage.engine.video_io import VideoSampling, decode_video

    path, root, raw, kw, llm = glm_video
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    vc = llm.engine.mm_encoder.config
    pair = decode_video(raw, sampling=VideoSampling(num_frames=4))
    assert pair[1]["frames_indices"] == [0, 1, 3, 5]
    img = smooth_image(100, 40, seed=1)  # 4 rows
    clip = {"type": "video_url", "video_url": {"url": f"file://{root}/clip.mkv"}}
    inline = {"type": "video_url", "video_url": {"url": "data:video/x-matroska;base64,"
                                                        + base64.b64encode(raw).decode()}}
    cases = [(clip,), (inline, img)]
    wants = []
    for parts in cases:
        data = {"video": [pair], **({"image": [img]} if len(parts) > 1 else {})}
        ids = _rendered_ids(tok, ["video", "image"][:len(parts)])
        want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": data}, params, use_tqdm=False)[0]
        assert want.error is None, want.error
        got = want.prompt_token_ids
        assert got.count(vc.image_token_id) == 2 * 6 + 4 * (len(parts) - 1)
        assert tok.decode(got).replace(" ", "").count("<|end_of_image|>0<|begin_of_image|>") == 1
        assert tok.decode(got).replace(" ", "").count("<|end_of_image|>1<|end_of_video|>") == 1
        wants.append(want)
    # two videos: their frames' rows over max_model_len, refused before they run, by its length
    assert_served_as(path, kw, cases, wants, [clip, clip], 56)
    outs = llm.chat([_msg("the quick brown fox", *parts) for parts in cases], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [w.prompt_token_ids for w in wants]
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in wants]


def test_frame_sampling_per_request(glm_video):
    """A request's mm_processor_kwargs asking do_sample_frames at 0.5 a second: of the 3 s
    file, frame 0 (twice: one frame group), held by the 4 decoded, through LLM.chat and the
    server, as LLM.generate on that frame; at 1 a second it picks frames 2 and 4, which the
    decoded frames lack: a 400 naming them."""
    from flashpage.engine.video_io import VideoSampling, decode_video

    path, root, raw, kw, llm = glm_video
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    frames, meta = decode_video(raw, sampling=VideoSampling(num_frames=4))
    one = (frames[[0, 0]], {**meta, "frames_indices": [0, 0]})
    want = llm.generate({"prompt_token_ids": _rendered_ids(llm.get_tokenizer(), ["video"]),
                         "multi_modal_data": {"video": [one]}}, params, use_tqdm=False)[0]
    assert want.error is None and want.prompt_token_ids.count(llm.engine.mm_encoder.config.image_token_id) == 6
    sample = {"do_sample_frames": True, "fps": 0.5}
    assert_sampled_as(llm, path, kw, f"file://{root}/clip.mkv", sample, want, {**sample, "fps": 1},
                      "do_sample_frames picks frame(s) [2, 4] of its 6")
