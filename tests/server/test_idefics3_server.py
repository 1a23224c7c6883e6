"""Chat completions with image_url parts on a tiny SmolVLM (server/images.py,
models/idefics3.py): one image (a grid of tiles and the global one) and two give
LLM.generate's tokens for the prompt SmolVLM's chat template renders (an <image> per image
part), usage counting each image's expanded prompt tokens; an over-long prompt is refused by
its length; LLM.chat with the same parts gives the server's tokens. SmolVLM2's video_url parts
(a file:// video and the same file as a data URL beside an image, engine/video_io.py sampling
it as --media-io-kwargs says; models/smolvlm_video.py) give LLM.generate's tokens for the
rendered prompt with its <video> written out and the decoded (frames, metadata) pair, usage
counting every frame's rows, and LLM.chat's; a prompt too long with two videos is refused by
its length."""

from __future__ import annotations

import base64

import pytest

from flashpage import LLM, SamplingParams
from tests.idefics3_checkpoint import ROWS, build_tiny_idefics3
from tests.llava_checkpoint import smooth_image
from tests.server.conftest import engine_kwargs
from tests.server.test_llava_server import (
    MAX_TOKENS,
    _msg,
    assert_sampled_as,
    assert_served_as,
)


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


@pytest.fixture(scope="module")
def smolvlm2(tmp_path_factory):
    """A tiny SmolVLM2 (its template writes <video> for a video part), a folder file:// URLs
    may name holding clip.mkv (6 frames, 2 a second), its bytes, and the engine's settings
    (the file sampled to 4 frames, --media-io-kwargs)."""
    pytest.importorskip("av")
    from tests.video_files import encode, pattern_frames

    tmp = tmp_path_factory.mktemp("smolvlm2_server")
    path = build_tiny_idefics3(tmp / "smolvlm2", smolvlm=True, video={"size": {"longest_edge": 32}})
    root = tmp / "media"
    root.mkdir()
    raw = encode(pattern_frames(6, 24, 20, seed=7), rate=2)
    (root / "clip.mkv").write_bytes(raw)
    kw = {"allowed_local_media_path": str(root), "media_io_kwargs": {"video": {"num_frames": 4}},
          "max_model_len": 400}  # a video and an image fit; two videos do not
    return path, root, raw, kw, LLM(str(path), **{**engine_kwargs(), **kw})


def _rendered(tok, kinds: list[str]) -> str:
    """SmolVLM2's template on one user message: these media parts, then the text."""
    parts = [{"type": k} for k in kinds] + [{"type": "text", "text": "the quick brown fox"}]
    return tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)


def test_video_urls_equal_generate_and_llm_chat(smolvlm2):
    """A file:// video_url and the same file as a data URL beside an image answer as
    LLM.generate on the decoded pair."""
    from flashpage.engine.video_io import VideoSampling, decode_video

    path, root, raw, kw, llm = smolvlm2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    enc = llm.engine.mm_encoder
    pair = decode_video(raw, sampling=VideoSampling(num_frames=4))
    assert pair[1]["frames_indices"] == [0, 1, 3, 5]  # 4 of the file's 6 frames
    img = smooth_image(20, 40, seed=1)
    clip = {"type": "video_url", "video_url": {"url": f"file://{root}/clip.mkv"}}
    inline = {"type": "video_url", "video_url": {"url": "data:video/x-matroska;base64,"
                                                        + base64.b64encode(raw).decode()}}
    cases = [(clip,), (inline, img)]
    wants = []
    for parts in cases:
        data = {"video": [pair], **({"image": [img]} if len(parts) > 1 else {})}
        text = enc.expand_videos(_rendered(tok, ["video", "image"][:len(parts)]), data)
        assert text.count("Frame from 00:0") == 4 and "series of four frames from a 0:00:03" in text
        ids = tok.encode(text, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": data}, params, use_tqdm=False)[0]
        assert want.error is None, want.error
        tiles = 4 + sum(enc.pixel_values(im).pixels.shape[0] for im in data.get("image", []))
        assert want.prompt_token_ids.count(enc.config.image_token_id) == ROWS * tiles  # each frame a tile
        wants.append(want)
    # two videos: their frames' rows over max_model_len, refused before they run, by its length
    assert_served_as(path, kw, cases, wants, [clip, clip], 400)
    outs = llm.chat([_msg("the quick brown fox", *parts) for parts in cases], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in wants]
    assert [o.prompt_token_ids for o in outs] == [w.prompt_token_ids for w in wants]


def test_frame_sampling_per_request(smolvlm2):
    """A request's mm_processor_kwargs asking SmolVLMVideoProcessor's do_sample_frames: 2 of
    the file's frames at 1 a second (its frames 0 and 5, held by the 4 decoded) through
    LLM.chat and the server, as LLM.generate on those two frames; picks the decoded frames
    lack (frame 2) are a 400 naming them."""
    from flashpage.engine.video_io import VideoSampling, decode_video

    path, root, raw, kw, llm = smolvlm2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tok = llm.get_tokenizer()
    frames, meta = decode_video(raw, sampling=VideoSampling(num_frames=4))
    two = (frames[[0, 3]], {**meta, "frames_indices": [0, 5]})
    text = llm.engine.mm_encoder.expand_videos(_rendered(tok, ["video"]), {"video": [two]})
    assert "series of two frames from a 0:00:03" in text and "Frame from 00:02:" in text
    want = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False),
                         "multi_modal_data": {"video": [two]}}, params, use_tqdm=False)[0]
    sample = {"do_sample_frames": True, "num_frames": 2, "fps": 1}
    assert_sampled_as(llm, path, kw, f"file://{root}/clip.mkv", sample, want, {**sample, "num_frames": 3},
                      "do_sample_frames picks frame(s) [2] of its 6")
