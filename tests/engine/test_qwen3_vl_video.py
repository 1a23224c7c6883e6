"""Qwen3-VL video input (models/qwen3_vl_video.py through models/qwen2_vl.QwenImageEncoder):
the prompt's per-frame-group timestamp text equal to what transformers' Qwen3VLProcessor
writes, its size rule equal to Qwen3VLVideoProcessor's smart_resize, its patch layout to
its patchify, the frame groups' 3-D positions to get_rope_index, the tower run per frame
group equal to one pass over the whole video, and greedy tokens equal to transformers'
generate (frames given with and without metadata, odd frame counts, PIL frames, an image and
a video in one prompt, text-only prompts beside them; chunked prefill and preemption through
videos; a prefix-cache hit on a repeated video; LLM.chat's video parts; Qwen3-VL-MoE too),
and bad videos refused by name without a leaked block. fp32, CPU (no torchvision here: the
video processor's resize itself is not run; ours is Qwen2-VL's, tested against PIL); one
CUDA test in bf16 (skipped without a GPU)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine.mrope import prompt_positions
from flashpage.models.qwen2_vl_image import normalize
from flashpage.models.qwen3_vl_video import smart_resize_video
from tests.conftest import assert_top_one_agreement
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import hf_qwen_greedy
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl, hf_qwen3_vl

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_video"))
    return path, hf_qwen3_vl(path)


def _frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.stack([np.asarray(smooth_image(h, w, seed=seed * 100 + i)) for i in range(n)])


def _ids(enc, items: str, seed: int) -> list[int]:
    """Text, then per letter of ``items`` ("i": image, "v": video) its placeholder triple
    and two text tokens, then more text."""
    vc = enc.config
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 200, (8 + 2 * len(items),), generator=g).tolist()
    ids = [1, *text[:3]]
    for k, c in enumerate(items):
        pad = vc.image_token_id if c == "i" else vc.video_token_id
        ids += [vc.vision_start_token_id, pad, vc.vision_end_token_id, *text[3 + 2 * k:5 + 2 * k]]
    return ids + text[3 + 2 * len(items):]


def _want(hf, llm, out, images=(), videos=(), max_new=MAX_NEW):
    """transformers' tokens: its whole-video patches and grids (t, h, w), as its processor
    gives them (get_rope_index cuts them per frame group itself)."""
    enc = llm.engine.mm_encoder
    return hf_qwen_greedy(hf, out.prompt_token_ids, [enc.pixel_values(im) for im in images], max_new,
                          [enc.video_values(v) for v in videos])


def _reference_video_text(grid, fps, indices) -> str:
    """Qwen3VLProcessor.replace_video_token's text for a video of ``grid`` (t, h, w) patches."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    proc = object.__new__(Qwen3VLProcessor)  # its tokenizer and processors are not needed here
    proc.video_processor = types.SimpleNamespace(merge_size=2, temporal_patch_size=2)
    proc.video_token, proc.vision_start_token, proc.vision_end_token = \
        "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
    md = VideoMetadata(total_num_frames=len(indices), fps=fps, frames_indices=list(indices))
    return proc.replace_video_token({"video_grid_thw": torch.tensor([list(grid)]), "video_metadata": [md]}, 0)


def test_prompt_is_qwen3vl_processors(qwen3):
    """Each <|video_pad|> becomes the text transformers' processor writes for the video
    (tokenized whole by the checkpoint's tokenizer): 5 frames without metadata (24 fps),
    the same with metadata fps 2 and the source frames they were sampled at, 4 frames at
    mm_processor_kwargs fps 0.5 (timestamps 1.0 and 5.0 seconds)."""
    path, _ = qwen3
    llm = _llm(path)
    tok = llm.get_tokenizer()
    enc = llm.engine.mm_encoder
    pad = enc.config.video_token_id
    five = _frames(5, 70, 100, 1)
    cases = [(five, None, list(range(5)), llm),
             ((five, {"fps": 2.0, "frames_indices": [0, 3, 7, 10, 14], "total_num_frames": 15}), 2.0,
              [0, 3, 7, 10, 14], llm),
             (_frames(4, 64, 64, 2), 0.5, list(range(4)), _llm(path, mm_processor_kwargs={"fps": 0.5}))]
    for video, fps, indices, engine in cases:
        ids = _ids(enc, "v", 3)
        out = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"video": video}}], GREEDY,
                              use_tqdm=False)[0]
        assert out.error is None, out.error
        v = engine.engine.mm_encoder.video_values(video)
        at = ids.index(pad)
        text = _reference_video_text(v.grid, fps, indices)
        want = ids[:at] + tok.encode(text, add_special_tokens=False) + ids[at + 1:]
        assert out.prompt_token_ids == want
        assert text.count("<|vision_start|>") == v.grid[0] and "seconds>" in text
    # frames at 0, 2, 4, 6 s: each group's time the mean of its two frames'
    assert _reference_video_text((2, 4, 4), 0.5, list(range(4))).replace("<|video_pad|>", "") == \
        "<1.0 seconds><|vision_start|><|vision_end|><5.0 seconds><|vision_start|><|vision_end|>"


def test_smart_resize_and_patches_equal_the_video_processor():
    """smart_resize_video equals Qwen3VLVideoProcessor's smart_resize (frames rounded to
    temporal patches, the bound over the whole video, small sides scaled up); our patches of
    normalized frames equal its patchify's layout (to float rounding)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )

    for t, h, w in [(2, 64, 64), (5, 70, 100), (8, 480, 640), (3, 20, 300), (64, 720, 1280), (9, 31, 33)]:
        for lo, hi in [(4096, 24576), (128 * 32 * 32, 768 * 32 * 32), (65536, 25165824)]:
            assert smart_resize_video(t, h, w, 2, 32, lo, hi) == smart_resize(t, h, w, 2, 32, lo, hi)
    with pytest.raises(ValueError, match="at least temporal_patch_size"):
        smart_resize_video(1, 64, 64, 2, 32, 4096, 24576)
    frames = torch.randint(0, 256, (4, 3, 64, 96), dtype=torch.uint8)
    from flashpage.config import QwenImageProcessing

    proc = QwenImageProcessing(1, 1 << 30, 1 / 255, (0.5,) * 3, (0.5,) * 3)
    ours = normalize(frames, proc, 16, 2, 2)
    x = ((frames.float() * (1 / 255) - 0.5) / 0.5)[None]
    ref, gt, gh, gw = Qwen3VLVideoProcessor.patchify(None, x, 16, 2, 2)
    assert (gt, gh, gw) == (2, 4, 6)
    torch.testing.assert_close(ours, ref[0], rtol=0, atol=1e-6)


def test_positions_and_tower_per_frame_group(qwen3):
    """The frame groups' inputs give get_rope_index's 3-D positions (an image and a video
    of 3 groups with timestamp text between them); encoding the groups apart gives the rows
    and deepstack features of one pass over the whole video."""
    path, hf = qwen3
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    vc = enc.config
    video = _frames(5, 70, 100, 4)
    ids, inputs = enc.prepare(_ids(enc, "iv", 5), {"image": smooth_image(60, 90, seed=1), "video": video})
    assert [mi.grid for mi in inputs] == [(1, 2, 3), (1, 2, 3), (1, 2, 3), (1, 2, 3)]
    x = torch.tensor([ids])
    types_ = (x == vc.image_token_id).int() + 2 * (x == vc.video_token_id).int()
    v = enc.video_values(video)
    ref, delta = hf.model.get_rope_index(x, types_, torch.tensor([[1, 4, 6]]), torch.tensor([list(v.grid)]))
    ours, our_delta = prompt_positions(len(ids), inputs)
    assert np.array_equal(ours, ref[:, 0].numpy()) and our_delta == int(delta)
    whole = enc.encode([v])[0]
    parts = enc.encode([mi.data for mi in inputs[1:]])
    torch.testing.assert_close(torch.cat([r for r, _ in parts]), whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([d for _, d in parts]), whole[1], rtol=1e-5, atol=1e-5)


def test_videos_equal_transformers(qwen3):
    """In one batch: 5 frames (padded to 6), the same with metadata, a list of PIL frames,
    an image and a video in one prompt, two videos in one prompt, a text-only prompt."""
    path, hf = qwen3
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    odd = _frames(5, 70, 100, 6)
    meta = (odd, {"fps": 2.0, "frames_indices": [0, 4, 8, 12, 16]})
    pil = [smooth_image(64, 64, seed=70 + i) for i in range(4)]
    img = smooth_image(100, 40, seed=7)
    cases = [(_ids(enc, "v", 10), [], [odd]), (_ids(enc, "v", 11), [], [meta]), (_ids(enc, "v", 12), [], [pil]),
             (_ids(enc, "iv", 13), [img], [odd]), (_ids(enc, "vv", 14), [], [pil, meta]), (_ids(enc, "", 15), [], [])]
    prompts = []
    for ids, ims, vids in cases:
        data = {**({"image": ims} if ims else {}), **({"video": vids} if vids else {})}
        prompts.append({"prompt_token_ids": ids, **({"multi_modal_data": data} if data else {})})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims, vids) for o, (_, ims, vids) in zip(outs, cases, strict=True)]
    pad = enc.config.video_token_id
    assert [sum(t == pad for t in o.prompt_token_ids) for o in outs] == [18, 18, 8, 18, 26, 0]
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids[:len(outs[0].prompt_token_ids)]  # timestamps
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_preemption_and_prefix_cache(qwen3, monkeypatch, async_scheduling):
    """Chunks of 5 tokens through videos' frame groups and timestamps, few blocks
    (preemption): transformers' tokens, each frame group encoded once; with the prefix cache,
    the same video prompt again hits every block but the last and runs no tower."""
    path, hf = qwen3
    llm = _llm(path, max_num_batched_tokens=5, block_size=4, num_gpu_blocks=24,
               enable_prefix_caching=False, async_scheduling=async_scheduling)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: encoded.append(len(data)) or encode(data))
    vids = [_frames(4, 64, 96, 20 + i) for i in range(3)]
    cases = [(_ids(enc, "v", 20 + i), vids[i]) for i in range(3)] + [(_ids(enc, "", 30), None)]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"video": v}} if v is not None else {})}
               for ids, v in cases]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if not async_scheduling:
        assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [_want(hf, llm, o, (), [v] if v is not None else [], 12)
                             for o, (_, v) in zip(outs, cases, strict=True)]
    assert sum(encoded) == 3 * 2  # each frame group once
    assert llm.engine.kv_manager.stats().blocks_used == 0
    cached = _llm(path)
    kv = cached.engine.kv_manager
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    hits = kv.prefix_hits
    spy: list[int] = []
    enc2 = cached.engine.mm_encoder
    encode2 = enc2.encode
    monkeypatch.setattr(enc2, "encode", lambda data: spy.append(len(data)) or encode2(data))
    again = cached.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert _tokens([again]) == _tokens([first])
    assert kv.prefix_hits - hits == (len(first.prompt_token_ids) - 1) // 8 * 8 and spy == []


def test_llm_chat_video_parts(qwen3):
    """LLM.chat: a {"type": "video"} part of PIL frames beside an image part: Qwen's template
    prints <|vision_start|><|video_pad|><|vision_end|>, the processor's timestamped frame
    groups inside it; transformers' tokens; that expanded prompt given back is kept. A
    video_url part outside the allowed folder is refused by name."""
    path, hf = qwen3
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    vc = enc.config
    frames = [smooth_image(64, 96, seed=90 + i) for i in range(4)]
    img = smooth_image(60, 90, seed=95)
    conv = [{"role": "user", "content": [{"type": "text", "text": "watch"}, {"type": "video", "video": frames},
                                         {"type": "image_pil", "image_pil": img}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    assert out.error is None, out.error
    got = out.prompt_token_ids
    first = got.index(vc.video_token_id)
    assert got[first - 1] == vc.vision_start_token_id and got.count(vc.vision_start_token_id) == 1 + 2 + 1
    assert _tokens([out])[0] == _want(hf, llm, out, [img], [frames])
    # the expanded prompt given back (timestamps and frame groups written out) is kept
    again = llm.generate([{"prompt_token_ids": got, "multi_modal_data": {"video": [frames], "image": [img]}}],
                         GREEDY, use_tqdm=False)[0]
    assert again.prompt_token_ids == got and _tokens([again]) == _tokens([out])
    with pytest.raises(ValueError, match="video 0: file:// URLs are read only under allowed_local_media_path"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///tmp/a.mp4"}}]}],
                 GREEDY, use_tqdm=False)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_bad_videos_are_refused_by_name_and_leak_nothing(qwen3):
    path, hf = qwen3
    llm = _llm(path)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    enc = llm.engine.mm_encoder
    ids = _ids(enc, "v", 40)
    video = _frames(4, 64, 64, 40)
    bad = [
        ({"video": video[:1]}, ["video 0 could not be read", "at least temporal_patch_size (2) frames"]),
        ({"video": [video, video]}, ["1 video token(s)", "2 video(s)"]),
        ({"video": (video, {"frames_indices": [0, 1]})}, ["frames_indices must be 4"]),
        ({"video": (video, {"fps": -1})}, ["fps must be a positive number"]),
        ({"video": video.astype(np.float32)}, ["uint8"]),
    ]
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"video": video}}] + \
        [{"prompt_token_ids": ids, "multi_modal_data": d} for d, _ in bad]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1])[0] == _want(hf, llm, outs[0], (), [video])
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0


def test_qwen3_vl_moe_video(tmp_path):
    """Qwen3-VL-MoE takes the same videos: transformers' tokens for a video beside an image."""
    path = build_tiny_qwen3_vl(tmp_path / "moe", moe=True)
    hf = hf_qwen3_vl(path)
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    video, img = _frames(6, 64, 96, 50), smooth_image(64, 64, seed=51)
    out = llm.generate([{"prompt_token_ids": _ids(enc, "vi", 50), "multi_modal_data": {"video": video, "image": img}}],
                       GREEDY, use_tqdm=False)[0]
    assert _tokens([out])[0] == _want(hf, llm, out, [img], [video])
    # 6 x 64 x 96 pixels over the bound 24 x 32 x 32: frames of 32 x 64, 3 groups of 2 rows
    assert sum(t == enc.config.video_token_id for t in out.prompt_token_ids) == 3 * math.prod((1, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_vl_video_on_the_gpu_bf16(tmp_path):
    """bf16 on CUDA (triton backend, CUDA graphs for decodes): videos beside images and
    text; tokens equal an eager engine's; teacher-forced on our tokens, our token is
    transformers' fp32 top one about as often as its own bf16 top token is (within 3
    points, at least 85%)."""
    path = build_tiny_qwen3_vl(tmp_path / "q3v", text=dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                         "mrope_interleaved": True}))
    hf = hf_qwen3_vl(path).to("cuda")
    hf16 = hf_qwen3_vl(path).to("cuda", torch.bfloat16)

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                  block_size=16, max_num_batched_tokens=64, **kw)
        enc = llm.engine.mm_encoder
        cases = [(_ids(enc, "v", 60 + i), _frames(4 + i, 64, 96, 60 + i)) for i in range(3)] + \
            [(_ids(enc, "", 70), None)]
        prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"video": v}} if v is not None else {})}
                   for ids, v in cases]
        return llm, cases, llm.generate(prompts, GREEDY, use_tqdm=False)

    llm, cases, outs = run()
    assert llm.engine.runner.graphs is not None
    graphed = _tokens(outs)
    assert graphed == _tokens(run(enforce_eager=True)[2])
    enc = llm.engine.mm_encoder

    def mm_inputs(i, x):
        if cases[i][1] is None:
            return {}
        vv = enc.video_values(cases[i][1])
        return dict(pixel_values_videos=vv.patches, video_grid_thw=torch.tensor([list(vv.grid)]),
                    mm_token_type_ids=2 * (x == enc.config.video_token_id).int())

    assert_top_one_agreement("qwen3_vl video", hf, hf16, outs, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
