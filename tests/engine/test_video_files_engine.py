"""Video files through the engine (engine/video_io.py, engine/multimodal.chat_images,
LLMEngine's multi_modal_data): on tiny Qwen2.5-VL and Qwen3-VL checkpoints a file:// video_url
in LLM.chat, and a path, a URL or bytes in multi_modal_data["video"], give the tokens of the
same sampled frames given directly with their metadata, and that metadata is what sets
Qwen2.5-VL's temporal position step (the sampled frames' rate) and Qwen3-VL's timestamps;
bad files are refused by name, the request beside them keeps its result and no KV block is
left held; a model without video input refuses a video_url part by name. fp32, CPU."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from flashpage import SamplingParams
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.video_files import encode, pattern_frames

pytest.importorskip("av")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
N, RATE = 12, 6  # a 2-second video of 12 frames
IDX = [0, 3, 7, 11]  # vLLM's 4 of 12: linspace(0, 11, 4)
IO = {"video": {"num_frames": 4}}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    frames = pattern_frames(N, 56, 84, seed=5)
    (root / "clip.mkv").write_bytes(encode(frames, rate=RATE))
    (root / "notes.mkv").write_bytes(b"no video here " * 20)
    (root / "empty.mkv").write_bytes(b"")
    return root, frames


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen25"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl

    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3"))


def _chat(text: str, part: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, part]}]


def _meta(frames: np.ndarray) -> tuple[np.ndarray, dict]:
    """The sampled frames with vLLM's metadata, as a caller gives them directly."""
    return frames[IDX], {"fps": float(RATE), "total_num_frames": N, "frames_indices": IDX,
                         "duration": N / RATE}


def test_qwen2_5_vl_video_url_equals_its_frames_and_sets_the_time_step(qwen25, media):
    root, frames = media
    llm = _llm(qwen25, allowed_local_media_path=str(root), media_io_kwargs=IO)
    enc = llm.engine.mm_encoder
    url = f"file://{root}/clip.mkv"
    out = llm.chat(_chat("watch", {"type": "video_url", "video_url": {"url": url}}), GREEDY, use_tqdm=False)[0]
    want = llm.chat(_chat("watch", {"type": "video", "video": _meta(frames)}), GREEDY, use_tqdm=False)[0]
    assert _tokens([out]) == _tokens([want]) and out.prompt_token_ids == want.prompt_token_ids
    # what the chat prompt hands the engine: the sampled frames exactly, with vLLM's metadata
    prompt = llm._chat_prompt(_chat("watch", {"type": "video_url", "video_url": {"url": url}}), True, None, {})
    (got, meta), = prompt["multi_modal_data"]["video"]
    assert np.array_equal(got, frames[IDX])
    assert meta == {"total_num_frames": N, "fps": float(RATE), "duration": N / RATE, "frames_indices": IDX,
                    "video_backend": "pyav"}
    # the sampled frames' rate (6 x 4 / 12 = 2 a second) sets the temporal step, not the default 24
    vc = enc.config
    _, inputs = enc.prepare(prompt["prompt_token_ids"], prompt["multi_modal_data"])
    assert [mi.time_step for mi in inputs] == [vc.tokens_per_second * vc.temporal_patch_size / 2.0]
    assert enc.admit_video(frames[IDX]).time_step != inputs[0].time_step
    # multi_modal_data: a path, a file:// URL, a data URL and the bytes give the same tokens
    ids = want.prompt_token_ids
    raw = (root / "clip.mkv").read_bytes()
    sources = [str(root / "clip.mkv"), url, "data:video/x-matroska;base64," + base64.b64encode(raw).decode(),
               raw, [raw]]
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"video": s}} for s in sources],
                        GREEDY, use_tqdm=False)
    assert _tokens(outs) == _tokens([want]) * len(sources)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_qwen3_vl_video_url_timestamps_come_from_the_file(qwen3, media):
    root, frames = media
    llm = _llm(qwen3, allowed_local_media_path=str(root), media_io_kwargs=IO)
    part = {"type": "video_url", "video_url": {"url": f"file://{root}/clip.mkv"}}
    out = llm.chat(_chat("watch", part), GREEDY, use_tqdm=False)[0]
    want = llm.chat(_chat("watch", {"type": "video", "video": _meta(frames)}), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == want.prompt_token_ids and _tokens([out]) == _tokens([want])
    # frame groups (0, 3) and (7, 11) at 6 fps: 0.25 s and 1.5 s (Qwen3VLProcessor's mean times)
    enc = llm.engine.mm_encoder

    def has(ids: list[int], text: str) -> bool:
        t = enc.tokenize(text)
        return any(ids[k:k + len(t)] == t for k in range(len(ids)))

    assert has(out.prompt_token_ids, f"<{0.25:.1f} seconds>") and has(out.prompt_token_ids, "<1.5 seconds>")
    bare = llm.chat(_chat("watch", {"type": "video", "video": frames[IDX]}), GREEDY, use_tqdm=False)[0]
    assert not has(bare.prompt_token_ids, "<1.5 seconds>")  # without metadata: 24 fps, frames 0..3
    assert has(bare.prompt_token_ids, "<0.1 seconds>")
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_bad_video_files_are_refused_by_name_and_leak_nothing(qwen3, media, monkeypatch):
    root, frames = media
    llm = _llm(qwen3, allowed_local_media_path=str(root), allowed_media_domains=["127.0.0.1"],
               media_io_kwargs=IO)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    good = llm.chat(_chat("watch", {"type": "video", "video": _meta(frames)}), GREEDY, use_tqdm=False)[0]
    ids = good.prompt_token_ids
    outside = root.parent / "outside.mkv"
    outside.write_bytes((root / "clip.mkv").read_bytes())
    bad = [
        (f"file://{root}/notes.mkv", ["video 0 could not be decoded"]),
        (f"file://{root}/empty.mkv", ["video 0 is empty"]),
        (b"\x00" * 64, ["video 0 could not be decoded"]),
        (f"file://{root}/../outside.mkv", ["video 0", "is not under allowed_local_media_path"]),
        ("https://blocked.invalid/a.mp4", ["video 0", "'blocked.invalid' is not in allowed_media_domains"]),
        (str(root / "none.mkv"), ["video 0", "could not be read"]),
        ([frames[IDX], b"junk"], ["video 1 could not be decoded"]),
    ]
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"video": str(root / "clip.mkv")}}]
    prompts += [{"prompt_token_ids": ids, "multi_modal_data": {"video": s}} for s, _ in bad]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1]) == _tokens([good])  # the neighbour keeps its result
    monkeypatch.setenv("FLASHPAGE_VIDEO_MAX_BYTES", "100")  # over the byte cap
    over = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": str(root / "clip.mkv")}},
                        GREEDY, use_tqdm=False)[0]
    assert over.error is not None and "more than 100 bytes (FLASHPAGE_VIDEO_MAX_BYTES)" in over.error
    with pytest.raises(ValueError, match="video 0: .*more than 100 bytes"):
        llm.chat(_chat("x", {"type": "video_url", "video_url": {"url": f"file://{root}/clip.mkv"}}), GREEDY,
                 use_tqdm=False)
    monkeypatch.delenv("FLASHPAGE_VIDEO_MAX_BYTES")
    for url, needle in ((f"file://{root}/notes.mkv", "video 0 could not be decoded"),
                        ("ftp://x/a.mp4", "video 0: its url must be a data URL")):
        with pytest.raises(ValueError, match=needle):
            llm.chat(_chat("x", {"type": "video_url", "video_url": {"url": url}}), GREEDY, use_tqdm=False)
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_a_model_without_video_refuses_video_url_by_name(tmp_path, media):
    from tests.llava_checkpoint import build_tiny_llava

    root, _ = media
    llm = _llm(build_tiny_llava(tmp_path / "llava"), allowed_local_media_path=str(root))
    for name in ("clip.mkv", "none.mkv"):  # refused before the file is read
        with pytest.raises(ValueError, match="takes no video input"):
            llm.chat(_chat("x", {"type": "video_url", "video_url": {"url": f"file://{root}/{name}"}}), GREEDY,
                     use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 5, 6], "multi_modal_data": {"video": str(root / "clip.mkv")}},
                       GREEDY, use_tqdm=False)[0]
    assert out.error is not None and "multi_modal_data ['video']: this model takes \"image\" only" in out.error
    assert llm.engine.kv_manager.stats().blocks_used == 0


ONEVISION_TEMPLATE = (  # llava-hf's OneVision template's shape: images, then videos, then text
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def test_llava_onevision_video_url_equals_its_frames(tmp_path, media):
    """LLaVA-OneVision: a video_url part becomes <video> where the template prints video parts
    and gives the tokens of the same sampled frames (its processor reads no fps)."""
    from tests.llava_onevision_checkpoint import build_tiny_llava_onevision

    root, frames = media
    path = build_tiny_llava_onevision(tmp_path / "ov")
    (path / "chat_template.jinja").write_text(ONEVISION_TEMPLATE)
    llm = _llm(path, allowed_local_media_path=str(root), media_io_kwargs=IO)
    vtok = llm.engine.mm_encoder.config.video_token_id
    out = llm.chat(_chat("watch", {"type": "video_url", "video_url": {"url": f"file://{root}/clip.mkv"}}), GREEDY,
                   use_tqdm=False)[0]
    want = llm.chat(_chat("watch", {"type": "video", "video": frames[IDX]}), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == want.prompt_token_ids and _tokens([out]) == _tokens([want])
    assert out.prompt_token_ids.count(vtok) > 1  # <video> made the video's rows
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_internvl_video_url_and_path_equal_its_frames(tmp_path, media):
    """InternVL: a video_url part (its template's <video>, written out as each frame's
    "FrameN: <img>...</img>" text) and a path in multi_modal_data give the tokens of the same
    sampled frames given directly."""
    from tests.internvl_checkpoint import build_tiny_internvl

    root, frames = media
    llm = _llm(build_tiny_internvl(tmp_path / "ivl"), allowed_local_media_path=str(root), media_io_kwargs=IO)
    url = f"file://{root}/clip.mkv"
    out = llm.chat(_chat("watch", {"type": "video_url", "video_url": {"url": url}}), GREEDY, use_tqdm=False)[0]
    want = llm.chat(_chat("watch", {"type": "video", "video": frames[IDX]}), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == want.prompt_token_ids and _tokens([out]) == _tokens([want])
    ctx = llm.engine.mm_encoder.config.image_token_id
    n = out.prompt_token_ids.count(ctx)  # the 4 sampled frames' rows, one tile each
    assert n > 0 and n % len(IDX) == 0
    text = "<video>\nwatch"
    by_path, direct = llm.generate([{"prompt": text, "multi_modal_data": {"video": str(root / "clip.mkv")}},
                                    {"prompt": text, "multi_modal_data": {"video": frames[IDX]}}],
                                   GREEDY, use_tqdm=False)
    assert by_path.prompt_token_ids == direct.prompt_token_ids and _tokens([by_path]) == _tokens([direct])
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_video_files_on_the_gpu_bf16(tmp_path, media):
    """bf16 on CUDA (triton backend, CUDA graphs), Qwen2.5-VL and Qwen3-VL: an MP4 (H.264 where
    the PyAV build encodes it) and the lossless file, as a file:// video_url in LLM.chat and as
    a path in multi_modal_data, give the tokens of their decoded frames given directly with
    their metadata, one request a call (the same batch each time); no block left held."""
    import av

    from flashpage import LLM
    from flashpage.engine.video_io import load_video
    from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl
    from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl
    from tests.video_files import LOSSY

    root, frames = media
    fmt, codec, pix = next(((f, c, p) for f, c, p in LOSSY if c in av.codecs_available), LOSSY[-1])
    (root / "clip.mp4").write_bytes(encode(frames, fmt, codec, pix, rate=RATE))
    text = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256)
    paths = [build_tiny_qwen2_vl(tmp_path / "q25", "qwen2_5_vl", text={**text, "rope_parameters": {
                 "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}}),
             build_tiny_qwen3_vl(tmp_path / "q3", text={**text, "rope_parameters": {
                 "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                 "mrope_interleaved": True}})]
    for path in paths:
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  allowed_local_media_path=str(root), media_io_kwargs=IO)
        assert llm.engine.runner.graphs is not None
        for name in ("clip.mp4", "clip.mkv"):
            decoded = load_video(str(root / name), 0, llm.engine.config.media_policy, allow_path=True)
            assert decoded[1]["frames_indices"] == IDX
            want = llm.chat(_chat("watch", {"type": "video", "video": decoded}), GREEDY, use_tqdm=False)[0]
            url = llm.chat(_chat("watch", {"type": "video_url", "video_url": {"url": f"file://{root}/{name}"}}),
                           GREEDY, use_tqdm=False)[0]
            by_path = llm.generate({"prompt_token_ids": want.prompt_token_ids,
                                    "multi_modal_data": {"video": str(root / name)}}, GREEDY, use_tqdm=False)[0]
            assert _tokens([url]) == _tokens([by_path]) == _tokens([want]), (path.name, name)
            assert url.prompt_token_ids == want.prompt_token_ids
        assert llm.engine.kv_manager.stats().blocks_used == 0
