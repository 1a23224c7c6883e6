"""SmolVLM2 video input through the engine (models/smolvlm_video.py: a prompt's <video> made
SmolVLMProcessor's text before tokenizing: the "You are provided the following series of N
frames from a H:MM:SS [H:MM:SS] video." header, each frame "\\nFrame from MM:SS:" and one
tile's image tokens, "\\n\\n" after). The prompt ids equal transformers' SmolVLMProcessor's
(its video processor needs torchvision, which the CPU image lacks: a stand-in hands it our
frames, normalized under the checkpoint's video processor's mean and std, which differ from
the images', and its metadata as transformers batches it), and greedy tokens equal
SmolVLMForConditionalGeneration.generate, for frames without metadata (fps 24), with vLLM's
metadata (frames_indices / fps / duration), two videos, and an image beside a video; a
frame's pixels are the PIL image processor's one tile; a video file's bytes equal its decoded
(frames, metadata) pair; LLM.chat's video part; frame sampling (do_sample_frames, per
request or by the video processor's file) picks transformers' frames and timestamps; bad
video requests are refused by name beside a good one, leaking nothing. fp32, CPU. On a GPU:
bf16 with CUDA graphs against transformers' bf16 and fp32 on the same frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flashpage import LLM, SamplingParams
from flashpage.models.smolvlm_video import (
    expand_video_text,
    frame_times,
    number_words,
    video_frames,
)
from tests.conftest import assert_top_one_agreement
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.idefics3_checkpoint import (
    ROWS,
    build_tiny_idefics3,
    hf_greedy,
    hf_idefics3,
    hf_image_processor,
)
from tests.llava_checkpoint import smooth_image

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
VIDEO_MEAN, VIDEO_STD = [0.4, 0.5, 0.6], [0.2, 0.3, 0.25]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny SmolVLM2: a <video> token, frames' longest edge 32 then the 16 x 16 tile, the
    video processor's mean and std other than the images' (0.5)."""
    path = build_tiny_idefics3(tmp_path_factory.mktemp("smolvlm_video"), smolvlm=True,
                               video={"size": {"longest_edge": 32}, "image_mean": VIDEO_MEAN,
                                      "image_std": VIDEO_STD})
    return path, hf_idefics3(path)


def _video(n: int, h: int = 20, w: int = 24, seed: int = 0) -> np.ndarray:
    return np.stack([np.asarray(smooth_image(h, w, seed=seed * 10 + i)) for i in range(n)])


def _hf_processor(path):
    """transformers' SmolVLMProcessor on the folder's tokenizer, built field by field (its
    __init__ wants torchvision's video processor)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    p = transformers.SmolVLMProcessor.__new__(transformers.SmolVLMProcessor)
    p.image_processor, p.tokenizer = hf_image_processor(True), tok
    p.fake_image_token, p.image_token, p.global_image_token = "<fake_token_around_image>", "<image>", "<global-img>"
    p.image_token_id = tok.convert_tokens_to_ids("<image>")
    p.end_of_utterance_token, p.video_token, p.image_seq_len = "<end_of_utterance>", "<video>", ROWS
    return p


def _hf(path, hf, vc, text: str, videos: list, metadata: list | None = None, images: list | None = None,
        **call) -> tuple[list[int], list[int]]:
    """(SmolVLMProcessor's ids for ``text``, transformers' greedy tokens on them): its video
    processor a stand-in giving our frames and transformers' own batched metadata (its
    defaults where none is given), the frames sampled first by transformers' own sampling
    where ``call`` asks (do_sample_frames, num_frames, fps: BaseVideoProcessor's
    _decode_and_sample_videos with SmolVLMVideoProcessor.sample_frames); an image's tiles
    from its image processor, in prompt order."""
    import types
    from functools import partial

    from transformers import BatchFeature
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import make_batched_metadata

    frames: list[torch.Tensor] = []
    proc = _hf_processor(path)

    def stand_in(videos, **kw):
        videos = list(videos)
        meta = make_batched_metadata(videos, video_metadata=kw.get("video_metadata"))
        if kw.get("do_sample_frames"):
            pick = partial(SmolVLMVideoProcessor.sample_frames, types.SimpleNamespace(), num_frames=kw["num_frames"],
                           fps=kw["fps"])
            videos, meta = BaseVideoProcessor._decode_and_sample_videos(
                types.SimpleNamespace(), videos, video_metadata=kw.get("video_metadata"), do_sample_frames=True,
                sample_indices_fn=pick)
        frames[:] = [video_frames(np.asarray(v), vc) for v in videos]
        assert all(f.dtype == torch.float32 for f in frames)  # normalized under the video processor's steps
        return BatchFeature({"pixel_values": torch.stack(frames), "video_metadata": meta})

    proc.video_processor = stand_in
    if metadata is not None:
        call["video_metadata"] = metadata
    out = proc(text=[text], images=[images] if images else None, videos=videos or None, return_tensors="pt", **call)
    if images:  # the processor keeps one pixel_values: the images' taken from its image processor
        tiles = proc.image_processor(images=[images], return_tensors="pt")["pixel_values"][0]
        first_image = text.index("<image>") < text.index("<video>")
        parts = [tiles, *frames] if first_image else [*frames, tiles]
    else:
        parts = frames
    px = torch.cat(parts)[None]
    ids = out["input_ids"][0].tolist()
    inputs = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "pixel_values": px,
              "pixel_attention_mask": torch.ones(px.shape[:2] + px.shape[3:], dtype=torch.long)}
    return ids, hf_greedy(hf, inputs, MAX_NEW)


def test_number_words_equal_num2words():
    from num2words import num2words  # the package SmolVLMProcessor writes the count with

    for n in [*range(0, 1200), 1999, 2100, 12_345, 100_000, 999_999]:
        assert number_words(n) == num2words(n), n


def test_videos_equal_transformers(ckpt):
    """A video without metadata (frame k at k / 24 s), one with vLLM's metadata (frames at
    frames_indices / fps: 00:00, 00:25, 01:05, 02:05 of a 2:10 video), two videos (a list of
    PIL frames and a tensor, of one frame count: the processor pads a batch's videos to the
    most frames and writes that count for each): the processor's ids and transformers' tokens; each frame
    through the tower once; no block left behind."""
    path, hf = ckpt
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    vc = enc.config
    v3, v4, v2 = _video(3, seed=1), _video(4, 30, 18, seed=2), _video(3, 16, 40, seed=3)
    meta = {"fps": 2.0, "frames_indices": [0, 50, 130, 250], "duration": 130.5, "total_num_frames": 261}
    cases = [
        ("the cat <video> runs fast", [v3], None, {"video": v3}),
        ("watch <video> now", [v4], [meta], {"video": (v4, meta)}),
        ("one <video> two <video> end", [v2, v3], None,
         {"video": [[Image.fromarray(f) for f in v2], torch.from_numpy(v3)]}),
    ]
    want = [_hf(path, hf, vc, t, vids, md) for t, vids, md, _ in cases]
    text = llm.get_tokenizer().decode(want[1][0])
    assert "series of four frames from a 0:02:10 [H:MM:SS] video." in text
    assert [x for x in ("00:00", "00:25", "01:05", "02:05") if f"Frame from {x}:" in text] == \
        ["00:00", "00:25", "01:05", "02:05"]
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    outs = llm.generate([{"prompt": t, "multi_modal_data": d} for t, _, _, d in cases], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids for ids, _ in want]
    assert _tokens(outs) == [t for _, t in want]
    assert sum(encoded) == 3 + 4 + 3  # v3 twice: its frames' rows shared
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_image_beside_a_video_and_frames_in_token_ids(ckpt):
    """An image (its tiles expanded here) then a video: transformers' tokens; the same
    prompt with the frames written out in token ids gives the same ids and tokens."""
    path, hf = ckpt
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    img, video = smooth_image(20, 40, seed=7), _video(2, seed=8)
    text = "see <image> and <video> what"
    ids, want = _hf(path, hf, vc, text, [video], images=[img])
    written = llm.get_tokenizer().encode(expand_video_text(text, vc, [frame_times(video, 2, 0)]))
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": img, "video": video}},
                         {"prompt_token_ids": written, "multi_modal_data": {"image": [img], "video": video}}],
                        GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids == outs[1].prompt_token_ids
    assert _tokens(outs) == [want, want]


def test_bad_video_requests_are_refused_by_name_and_leak_nothing(ckpt):
    path, hf = ckpt
    llm = _llm(path)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    vc = llm.engine.mm_encoder.config
    video = _video(3, seed=1)
    ids = llm.get_tokenizer().encode("the cat <video> runs")
    bad = [
        ({"prompt": "a <video> b", "multi_modal_data": {"video": np.zeros((0, 20, 24, 3), np.uint8)}},
         ["video 0 has no frames"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": video.astype(np.float32)}},
         ["video 0: frames must be uint8 (T, H, W, 3), got float32 [3, 20, 24, 3]"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": [video, video]}},
         ["the prompt has 1 video placeholder(s) (<video>) but 2 video(s) were given"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": (video, {"fps": 2.0, "frames_indices": [0, 4]})}},
         ["video 0: metadata frames_indices has 2 entries for its 3 frames"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": (video, {"fps": 0})}},
         ["video 0: metadata fps must be a positive number, got 0"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": video}},
         ["ids hold <video> (id", "not expanded in token ids", "give the prompt as text"]),
        ({"prompt_token_ids": [1, 5, 6, 7], "multi_modal_data": {"video": video}},
         ["the prompt has 0 video frame(s)", "in token ids write them out"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"image": smooth_image(16, 16)}},
         ["the prompt has video tokens (<video>, id", "but no video was given"]),
        ({"prompt_token_ids": ids}, ["the prompt has video tokens (<video>, id", "but no video was given"]),
    ]
    good = ("the cat <video> runs fast", video)
    outs = llm.generate([{"prompt": good[0], "multi_modal_data": {"video": good[1]}}, *(b for b, _ in bad)],
                        GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1]) == [_hf(path, hf, vc, good[0], [good[1]])[1]]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_frames_are_the_processors_single_tile(ckpt):
    """A frame's pixels equal transformers' SmolVLMImageProcessorPil's one tile without
    splitting under the video processor's longest edge, mean and std (the same two resizes:
    the longest edge, then the tile's square), within a uint8 level."""
    path, _ = ckpt
    vc = _llm(path).engine.mm_encoder.config
    video = _video(3, 30, 18, seed=4)
    proc = hf_image_processor(True, do_image_splitting=False, size={"longest_edge": 32}, image_mean=VIDEO_MEAN,
                              image_std=VIDEO_STD)
    want = proc(images=[[Image.fromarray(f)] for f in video], return_tensors="pt")["pixel_values"][:, 0]
    got = video_frames(video, vc)
    assert got.shape == want.shape == (3, 3, 16, 16)
    assert torch.allclose(got, want.float(), atol=1.01 / 255 / min(VIDEO_STD))


def test_video_file_equals_its_decoded_frames(ckpt):
    """A video file's bytes (engine/video_io.py: its frames sampled, its metadata's fps and
    frames_indices) give the ids and tokens of the (frames, metadata) pair it decodes to."""
    from flashpage.engine.video_io import decode_video
    from tests.video_files import encode, pattern_frames

    pytest.importorskip("av")
    path, _ = ckpt
    llm = _llm(path)
    raw = encode(pattern_frames(6, 24, 20), rate=2)
    pair = decode_video(raw)
    text = "a <video> b"
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"video": raw}},
                         {"prompt": text, "multi_modal_data": {"video": pair}}], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert _tokens(outs[:1]) == _tokens(outs[1:])
    times, _ = frame_times(pair, len(pair[0]), 0)
    assert times[-1] >= 1 and f"Frame from 00:{int(times[-1]):02d}:" in llm.get_tokenizer().decode(
        outs[0].prompt_token_ids)


def test_chat_video_part(ckpt):
    """LLM.chat's {"type": "video", "video": frames} part under SmolVLM2's chat template
    (SmolVLMProcessor's DEFAULT_CHAT_TEMPLATE, which writes <video>): the <video> written out
    into the rendered text and tokenized with it; the processor's ids on the rendered text (no
    special tokens added, as its apply_chat_template) and transformers' tokens."""
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    path, hf = ckpt
    llm = _llm(path)
    tok = llm.get_tokenizer()
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE  # the checkpoint's (tests/idefics3_checkpoint.py)
    vc = llm.engine.mm_encoder.config
    video = _video(2, 30, 18, seed=10)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert "<video>what happens?" in rendered
    conv = [{"role": "user", "content": [{"type": "video", "video": [Image.fromarray(f) for f in video]},
                                         {"type": "text", "text": "what happens?"}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    ids, want = _hf(path, hf, vc, rendered, [video], add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert _tokens([out]) == [want]


def test_frame_sampling_equals_transformers(ckpt, tmp_path):
    """do_sample_frames (SmolVLMVideoProcessor's, models/smolvlm_video.sample_video) asked per
    request: transformers' picks (its own sample_frames on the same metadata: 4 of 12 frames;
    3 of 40, a second skipped at each end) and timestamps, so its processor's ids and its
    greedy tokens; a metadata without total_num_frames counts the frames given. Asked by the
    video processor's file (video_sampling's max_frames / fps): the same as per request, and
    a request's do_sample_frames false takes the frames as given. Refused by name: no fps /
    duration, picks a sampled video lacks, sampling without num_frames / fps, a bad count."""
    import json
    import shutil

    path, hf = ckpt
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    v12, v40 = _video(12, seed=20), _video(40, 8, 12, seed=21)
    m12 = {"fps": 4.0, "duration": 3.0, "total_num_frames": 12}
    m40 = {"fps": 4.0, "duration": 10.0, "total_num_frames": 40}
    k12 = {"do_sample_frames": True, "num_frames": 4, "fps": 2}
    k40 = {"do_sample_frames": True, "num_frames": 3, "fps": 0.5}
    text = "the cat <video> runs fast"
    want = [_hf(path, hf, vc, text, [v12], [m12], **k12), _hf(path, hf, vc, text, [v40], [m40], **k40)]
    decoded = [llm.get_tokenizer().decode(ids) for ids, _ in want]
    assert "series of four frames from a 0:00:03" in decoded[0] and "series of three frames from a 0:00:10" in decoded[1]
    assert [x for x in ("00:01", "00:05", "00:09") if f"Frame from {x}:" in decoded[1]] == ["00:01", "00:05", "00:09"]
    bare = {k: v for k, v in m40.items() if k != "total_num_frames"}
    prompts = [{"prompt": text, "multi_modal_data": {"video": (v12, m12)}, "mm_processor_kwargs": k12},
               {"prompt": text, "multi_modal_data": {"video": (v40, m40)}, "mm_processor_kwargs": k40},
               {"prompt": text, "multi_modal_data": {"video": (v40, bare)}, "mm_processor_kwargs": k40}]
    bad = [({"video": v12}, k12, "video 0: do_sample_frames picks frames by the video's fps and duration, but its "
            "metadata gives no fps or duration"),
           ({"video": (v12[:4], {**m12, "frames_indices": [0, 4, 8, 11]})}, k12,
            "video 0: do_sample_frames picks frame(s) [3, 7] of its 12, which it does not hold"),
           ({"video": (v12, m12)}, {"do_sample_frames": True}, "do_sample_frames needs num_frames (video_sampling "
            "max_frames) and fps, got num_frames None and fps None"),
           ({"video": (v12, m12)}, {**k12, "num_frames": 0}, "num_frames must be an int >= 1, got 0")]
    outs = llm.generate(prompts + [{"prompt": text, "multi_modal_data": d, "mm_processor_kwargs": k}
                                   for d, k, _ in bad], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs[:3]] == [want[0][0], want[1][0], want[1][0]]
    assert _tokens(outs[:3]) == [want[0][1], want[1][1], want[1][1]]
    for out, (_, _, needle) in zip(outs[3:], bad, strict=True):
        assert out.error is not None and needle in out.error, out.error
    assert llm.engine.kv_manager.stats().blocks_used == 0
    # the video processor's file asks: the same picks without a request's kwargs
    sampled = tmp_path / "sampled"
    shutil.copytree(path, sampled)
    cfg = json.loads((sampled / "video_preprocessor_config.json").read_text())
    cfg.update(do_sample_frames=True, video_sampling={"fps": 2, "max_frames": 4, "video_size": {"longest_edge": 32}})
    (sampled / "video_preprocessor_config.json").write_text(json.dumps(cfg))
    outs = _llm(sampled).generate([{"prompt": text, "multi_modal_data": {"video": (v12, m12)}},
                                   {"prompt": text, "multi_modal_data": {"video": (v12, m12)},
                                    "mm_processor_kwargs": {"do_sample_frames": False}}], GREEDY, use_tqdm=False)
    as_given = llm.generate({"prompt": text, "multi_modal_data": {"video": (v12, m12)}}, GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == want[0][0] and _tokens(outs[:1]) == [want[0][1]]
    assert outs[1].prompt_token_ids == as_given[0].prompt_token_ids != want[0][0]
    assert _tokens(outs[1:]) == _tokens(as_given)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_smolvlm_video_on_the_gpu_bf16(tmp_path, monkeypatch):
    """bf16 on CUDA (triton backend, CUDA graphs for decodes): videos (without metadata, with
    vLLM's, of 2 to 4 frames) beside a text prompt; tokens equal an eager engine's;
    teacher-forced on our tokens, our token is transformers' fp32 top one about as often as
    its own bf16 top token is (within 3 points, at least 85%), on the same frames. Our
    greedy runs stop at a generated <image> or <fake_token_around_image> (the tiny
    vocabulary has them), which is compared but not fed back: transformers would take a
    fed <image> for a placeholder without its frame."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = build_tiny_idefics3(tmp_path / "sv64", smolvlm=True,
                               text=dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),  # head_dim 64
                               video={"size": {"longest_edge": 32}, "image_mean": VIDEO_MEAN,
                                      "image_std": VIDEO_STD})
    hf = hf_idefics3(path, device="cuda")
    hf16 = hf_idefics3(path, dtype=torch.bfloat16, device="cuda")
    meta = {"fps": 2.0, "frames_indices": [0, 50, 130, 250], "duration": 130.5, "total_num_frames": 261}
    videos = [_video(2, seed=60), (_video(4, 30, 18, seed=61), meta), _video(3, 16, 40, seed=62), None]
    texts = ["the cat <video> runs fast", "watch <video> now", "<video> what happens next", "the quick brown fox"]

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  max_num_batched_tokens=128, **kw)
        vc = llm.engine.mm_encoder.config
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                stop_token_ids=[vc.image_token_id, vc.fake_token_id])
        prompts = [{"prompt": t, **({"multi_modal_data": {"video": v}} if v is not None else {})}
                   for t, v in zip(texts, videos, strict=True)]
        return llm, llm.generate(prompts, params, use_tqdm=False)

    llm, outs = run()
    assert llm.engine.runner.graphs is not None
    assert _tokens(outs) == _tokens(run(enforce_eager=True)[1])
    vc = llm.engine.mm_encoder.config
    assert [o.prompt_token_ids.count(vc.image_token_id) for o in outs] == [ROWS * n for n in (2, 4, 3, 0)]

    def mm_inputs(i, x):
        if videos[i] is None:
            return {}
        px = video_frames(videos[i], vc)[None]  # [1, F, 3, M, M], normalized under the video processor's steps
        return {"pixel_values": px, "pixel_attention_mask": torch.ones(px.shape[:2] + px.shape[3:], dtype=torch.long)}

    assert_top_one_agreement("smolvlm2 video", hf, hf16, outs, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
