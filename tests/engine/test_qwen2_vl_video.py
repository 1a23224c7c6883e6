"""Qwen2-VL / Qwen2.5-VL video input through the engine (models/qwen2_vl.py,
models/qwen2_vl_video.py, engine/mrope.py): greedy tokens equal transformers' generate with
the same patches (even and odd frame counts, vLLM's three forms of a video, an image and a
video in one prompt, text-only requests beside them; Qwen2.5-VL's fps-scaled temporal
positions, chunked prefill cutting through a video), the preprocessing equal to transformers'
per-frame processor, the tower cut between frame groups equal to one pass, the prefix cache,
limit_mm_per_prompt, LLM.chat's video parts, and bad requests refused by name without a leaked
block. fp32, CPU; one CUDA test in bf16 (skipped without a GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import assert_top_one_agreement
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl, hf_inputs, hf_qwen, hf_qwen_greedy

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    built = {}

    def get(variant: str):
        if variant not in built:
            path = build_tiny_qwen2_vl(tmp_path_factory.mktemp(variant), variant)
            built[variant] = (path, hf_qwen(path, variant))
        return built[variant]

    return get


def _frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """A smooth moving video: uint8 (n, h, w, 3) (smooth so resizing keeps it near itself)."""
    return np.stack([np.asarray(smooth_image(h, w, seed=seed * 100 + i)) for i in range(n)])


def _ids(enc, n_text: int, items: str, seed: int) -> list[int]:
    """Prompt ids: text, then per letter of ``items`` ("i": image, "v": video) its
    placeholder and two text tokens, then the rest."""
    vc = enc.config
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 200, (n_text + 2 * len(items),), generator=g).tolist()
    ids = [1, *text[:3]]
    for k, c in enumerate(items):
        pad = vc.image_token_id if c == "i" else vc.video_token_id
        ids += [vc.vision_start_token_id, pad, vc.vision_end_token_id, *text[3 + 2 * k:5 + 2 * k]]
    return ids + text[3 + 2 * len(items):]


def _want(hf, llm, out, images=(), videos=(), max_new=MAX_NEW):
    enc = llm.engine.mm_encoder
    return hf_qwen_greedy(hf, out.prompt_token_ids, [enc.pixel_values(im) for im in images], max_new,
                          [enc.video_values(v) for v in videos])


def _count(out, token: int) -> int:
    return sum(t == token for t in out.prompt_token_ids)


def test_videos_equal_transformers(qwen):
    """Qwen2-VL: a video of 4 frames (2 temporal patches), one of 3 (its last frame repeated
    to 4), a list of PIL frames, a torch tensor, two videos in one prompt, an image and a
    video in one prompt, and a text-only prompt, in one batch."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    vc = enc.config
    even, odd = _frames(4, 84, 112, 1), _frames(3, 60, 90, 2)
    pil = [smooth_image(56, 84, seed=30 + i) for i in range(2)]
    img = smooth_image(100, 40, seed=4)
    cases = [
        (_ids(enc, 8, "v", 0), [], [even], even),
        (_ids(enc, 8, "v", 1), [], [odd], odd),
        (_ids(enc, 8, "v", 2), [], [pil], pil),
        (_ids(enc, 8, "v", 3), [], [even], torch.from_numpy(even)),
        (_ids(enc, 8, "vv", 4), [], [odd, pil], [odd, pil]),
        (_ids(enc, 8, "iv", 5), [img], [even], even),
        (_ids(enc, 8, "", 6), [], [], None),
    ]
    prompts = []
    for ids, ims, _, given in cases:
        data = {**({"image": ims} if ims else {}), **({"video": given} if given is not None else {})}
        prompts.append({"prompt_token_ids": ids, **({"multi_modal_data": data} if data else {})})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims, vids) for o, (_, ims, vids, _) in zip(outs, cases, strict=True)]
    # 84 x 112: 3 x 4 merged units per frame pair, 2 pairs; 60 x 90 -> 56 x 84: 2 x 3, 2 pairs
    # (3 frames padded to 4); 56 x 84 frames: 2 x 3, 1 pair
    assert [_count(o, vc.video_token_id) for o in outs] == [24, 12, 6, 24, 18, 24, 0]
    assert _count(outs[5], vc.image_token_id) == 4
    assert enc.admit_video(odd).pixels.shape[0] == 4
    assert torch.equal(enc.admit_video(odd).pixels[3], enc.admit_video(odd).pixels[2])
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_qwen2_5_vl_fps_scaled_positions_chunked_prefill_and_preemption(qwen, monkeypatch):
    """Qwen2.5-VL (windowed tower): mm_processor_kwargs fps 4 gives a video of 2 temporal
    patches the temporal positions 0 and 2 (tokens_per_second 4 x 2 frames / 4 fps); a
    video given with its metadata (fps 8) gives 0 and 1; prompts cut into chunks of 6
    tokens, few blocks (preempted requests recompute their videos' rows without encoding
    them again). transformers' tokens with the same second_per_grid_ts; the positions
    differ from the unscaled ones (so the scaling is what makes the tokens agree)."""
    path, hf = qwen("qwen2_5_vl")
    llm = _llm(path, mm_processor_kwargs={"fps": 4}, max_num_batched_tokens=6, block_size=4,
               num_gpu_blocks=16, enable_prefix_caching=False)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: encoded.append(len(data)) or encode(data))
    a, b = _frames(4, 84, 112, 7), _frames(4, 84, 112, 8)
    img = smooth_image(60, 90, seed=9)
    cases = [(_ids(enc, 6, "v", 10), [], [a], a),
             (_ids(enc, 6, "vi", 11), [img], [(b, {"fps": 8.0})], (b, {"fps": 8.0})),
             (_ids(enc, 6, "", 12), [], [], None)]
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {**({"image": ims} if ims else {}), "video": g}}
               if g is not None else {"prompt_token_ids": ids} for ids, ims, _, g in cases]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [_want(hf, llm, o, ims, v, 16) for o, (_, ims, v, _) in zip(outs, cases, strict=True)]
    assert sum(encoded) == 3  # two videos and an image, each once
    assert enc.admit_video(a).time_step == 2.0 and enc.admit_video((b, {"fps": 8.0})).time_step == 1.0
    assert enc.admit_video((b, {"fps": 8.0, "frames_indices": [0, 2, 4, 6], "total_num_frames": 8})
                           ).time_step == 2.0  # transformers' sampled_fps: 8 x 4 / 8
    from flashpage.engine.mrope import prompt_positions

    req = llm.engine.mm_encoder.prepare(prompts[0]["prompt_token_ids"], prompts[0]["multi_modal_data"])
    pos, _ = prompt_positions(len(req[0]), req[1])
    first = req[1][0].offset
    assert sorted(set(pos[0, first:first + 24] - pos[0, first])) == [0, 2]
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_positions_follow_qwens_rule_where_transformers_5_24_differs(qwen):
    """A video whose temporal extent passes its height and width (8 frame pairs of one 2 x 2
    merged grid; Qwen2.5-VL at time step 2): its rows take transformers' own vision
    positions (get_vision_position_ids), the text after it continues from their largest
    component + 1 (Qwen's release, vLLM; transformers 5.24 continues from p + max(h, w)),
    and decode continues the prompt's last position + 1."""
    from flashpage.engine.mrope import prompt_positions

    path, hf = qwen("qwen2_5_vl")
    llm = _llm(path, mm_processor_kwargs={"fps": 4})
    enc = llm.engine.mm_encoder
    ids = _ids(enc, 4, "v", 20)
    new_ids, inputs = enc.prepare(ids, {"video": _frames(16, 56, 56, 21)})
    (mi,) = inputs
    assert mi.grid == (8, 2, 2) and mi.time_step == 2.0
    pos, delta = prompt_positions(len(new_ids), inputs)
    want = hf.model.get_vision_position_ids(mi.offset, torch.tensor([8, 4, 4]), 1, 2, 2.0)
    assert torch.equal(torch.from_numpy(pos[:, mi.offset:mi.offset + mi.length]), want)
    after = mi.offset + mi.length
    assert (pos[:, after] == mi.offset + 14 + 1).all()  # temporal max: 7 x 2
    assert pos[0, -1] + 1 == len(new_ids) + delta  # the first decode position follows


def test_video_patches_equal_transformers_per_frame_processor(qwen):
    """The video's patches against transformers' image processor run on each frame (no
    resize: 56 x 84 is 28's multiple inside the bounds): patch (c, temporal k, row, col)
    holds frame 2t + k's value; an odd count's padding repeats the last frame."""
    import transformers

    path, _ = qwen("qwen2_vl")
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    frames = _frames(3, 56, 84, 40)
    got = enc.video_values(frames)
    assert got.grid == (2, 4, 6)
    proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    from PIL import Image

    per = [proc(images=[Image.fromarray(f)], return_tensors="pt")["pixel_values"] for f in frames]
    per.append(per[-1])
    ps, tp = enc.config.patch_size, enc.config.temporal_patch_size
    want = []
    for t in range(2):
        a, b = (p.view(-1, 3, tp, ps, ps) for p in per[2 * t:2 * t + 2])
        want.append(torch.stack([a[:, :, 0], b[:, :, 0]], dim=2).reshape(a.shape[0], -1))
    assert torch.allclose(got.patches, torch.cat(want), atol=1e-6)


def test_tower_cut_between_frame_groups_equals_one_pass(qwen):
    """encode with call_rows of one frame group's rows (a video of 3 groups and an image in
    four tower calls) gives one pass's rows (attention is within a frame group)."""
    for variant in ("qwen2_vl", "qwen2_5_vl"):
        path, _ = qwen(variant)
        enc = _llm(path).engine.mm_encoder
        data = [enc.admit_video(_frames(6, 84, 112, 50)), enc.admit_image(smooth_image(60, 90, seed=51))]
        enc.call_rows = None
        whole = enc.encode(data)
        enc.call_rows = 12
        cut = enc.encode(data)
        assert [r.shape for r in cut] == [r.shape for r in whole] == [(36, 64), (6, 64)]
        for a, b in zip(cut, whole, strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_prefix_cache_hits_a_repeated_video_not_another_fps(qwen, monkeypatch):
    """The same prompt and video again hits its blocks (no tower run); the same frames at
    another fps (Qwen2.5-VL: other temporal positions) share only the text before them."""
    path, hf = qwen("qwen2_5_vl")
    llm = _llm(path)
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: encoded.append(len(data)) or encode(data))
    frames = _frames(4, 84, 112, 60)
    ids = _ids(enc, 30, "v", 61)

    def run(video):
        return llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"video": video}}], GREEDY,
                            use_tqdm=False)[0]

    first = run(frames)
    hits = kv.prefix_hits
    again = run(frames.copy())
    n = len(first.prompt_token_ids)
    assert _tokens([again]) == _tokens([first]) and kv.prefix_hits - hits == (n - 1) // 8 * 8
    assert encoded == [1]
    hits = kv.prefix_hits
    other = run((frames, {"fps": 8.0}))
    assert kv.prefix_hits == hits  # the video starts in block 0: nothing shared
    assert encoded == [1, 1]
    assert _tokens([other])[0] == _want(hf, llm, other, videos=[(frames, {"fps": 8.0})])
    assert kv.stats().blocks_used == 0


def test_limit_mm_per_prompt_counts_videos(qwen):
    """{"video": 1}: two videos in one prompt refused by name, the others run; {"image": 0}
    still loads the tower for videos; {"image": 0, "video": 0} serves the text model alone."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path, limit_mm_per_prompt={"video": 1})
    enc = llm.engine.mm_encoder
    v = _frames(2, 56, 56, 70)
    two = {"prompt_token_ids": _ids(enc, 4, "vv", 71), "multi_modal_data": {"video": [v, v]}}
    one = {"prompt_token_ids": _ids(enc, 4, "v", 72), "multi_modal_data": {"video": v}}
    outs = llm.generate([two, one], GREEDY, use_tqdm=False)
    assert outs[0].error is not None and "2 video item(s)" in outs[0].error and "{'video': 1}" in outs[0].error
    assert _tokens([outs[1]])[0] == _want(hf, llm, outs[1], videos=[v])
    assert llm.engine.kv_manager.stats().blocks_used == 0
    assert _llm(path, limit_mm_per_prompt={"image": 0}).engine.mm_encoder is not None
    assert _llm(path, limit_mm_per_prompt={"image": 0, "video": 0}).engine.mm_encoder is None


def test_llm_chat_video_parts(qwen):
    """LLM.chat: a {"type": "video"} part of PIL frames, and one of image data URLs read as
    frames, each printed as <|vision_start|><|video_pad|><|vision_end|> by Qwen's template
    where the part is; the tokens equal generate's on the template's ids; a video_url part
    outside the allowed folder, or a data URL that is no video, is refused naming the video
    (video files: tests/engine/test_video_files_engine.py)."""
    from tests.engine.test_qwen2_vl_engine import _data_url

    path, hf = qwen("qwen2_vl")
    llm = _llm(path)
    tok = llm.get_tokenizer()
    enc = llm.engine.mm_encoder
    frames = [smooth_image(56, 84, seed=80 + i) for i in range(4)]
    img = smooth_image(60, 90, seed=85)
    for video in (frames, [_data_url(f) for f in frames]):
        conv = [{"role": "user", "content": [{"type": "text", "text": "watch"}, {"type": "video", "video": video},
                                             {"type": "text", "text": "and"},
                                             {"type": "image_pil", "image_pil": img}]}]
        out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
        assert out.error is None, out.error
        got = out.prompt_token_ids
        vs, vpad, ve = enc.video_placeholder_ids
        at = got.index(vpad)
        assert got[at - 1] == vs and got[at:at + 13] == [vpad] * 12 + [ve]
        assert tok.decode(got[:at - 1]).endswith("watch")
        parts = [{"type": "text", "text": "watch"}, {"type": "video"}, {"type": "text", "text": "and"},
                 {"type": "image"}]
        ids = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        want = llm.generate([{"prompt_token_ids": list(ids), "multi_modal_data": {"image": [img], "video": [frames]}}],
                            GREEDY, use_tqdm=False)[0]
        assert want.prompt_token_ids == got
        assert out.outputs[0].token_ids == want.outputs[0].token_ids == _want(hf, llm, out, [img], [frames])
    for part, needle in (({"type": "video_url", "video_url": {"url": "file:///tmp/clip.mp4"}},
                          "video 0: file:// URLs are read only under allowed_local_media_path"),
                         ({"type": "video", "video": "data:video/mp4;base64,AAAA"}, "video 0 could not be decoded")):
        with pytest.raises(ValueError, match=needle):
            llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_bad_video_requests_are_refused_by_name_and_leak_nothing(qwen):
    path, hf = qwen("qwen2_vl")
    llm = _llm(path, max_model_len=96)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    enc = llm.engine.mm_encoder
    vc = enc.config
    v = _frames(2, 56, 56, 90)
    ids = _ids(enc, 4, "v", 91)
    plain = [t for t in ids if t != vc.video_token_id]
    bad = [
        ({"prompt_token_ids": plain, "multi_modal_data": {"video": v}}, ["0 video token(s)", "1 video(s)"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": [v, v]}}, ["1 video token(s)", "2 video(s)"]),
        ({"prompt_token_ids": ids}, ["<|video_pad|>", "no video was given"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": v.astype(np.float32)}},
         ["video 0", "uint8 (T, H, W, 3)", "float32"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": v.transpose(0, 3, 1, 2).copy()}},
         ["video 0", "[2, 3, 56, 56]"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": [smooth_image(56, 56), smooth_image(56, 84)]}},
         ["video 0", "differ in size"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": "clip.mp4"}}, ["video 0", "clip.mp4", "could not be read"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": v[:0]}}, ["video 0 has no frames"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": (v, {"fps": -1})}}, ["fps", "positive"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": _frames(16, 112, 112, 92)}}, ["max_model_len is 96"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"speech": v}}, ["'speech'", "\"image\" and \"video\""]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"audio": v}}, ['"audio"', "takes no audio input"]),
    ]
    good = {"prompt_token_ids": _ids(enc, 4, "v", 93), "multi_modal_data": {"video": v}}
    batch = [good, *(b for b, _ in bad), plain]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens([outs[0], outs[-1]]) == [_want(hf, llm, outs[0], videos=[v]), _want(hf, llm, outs[-1])]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen_video_on_the_gpu_bf16(tmp_path):
    """bf16 on CUDA (triton backend, CUDA graphs): prompts with videos (even and odd frame
    counts, an image beside one) and a text-only one; graphed tokens equal eager ones, and
    against transformers on the GPU, teacher-forced on our tokens, our token is fp32's top
    one about as often as transformers' own bf16 top token is (within 3 points, at least
    85%: the Qwen2-VL image test's agreement form). The videos' temporal extents stay
    within their widths, where transformers 5.24's text-after-video rule is Qwen's
    (engine/mrope.py). Qwen2.5-VL's video positions at an fps are compared with transformers
    5.24's only (the CPU tests' reference): run 236 found transformers 5.17 (the GPU image's)
    placing them otherwise, whose fp32 on the CPU disagreed with our CPU fp32 tokens too; an
    older transformers checks graphed against eager there."""
    import transformers

    new_enough = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)
    for variant in ("qwen2_vl", "qwen2_5_vl"):
        path = build_tiny_qwen2_vl(tmp_path / variant, variant, text=dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}))
        hf = hf_qwen(path, variant).to("cuda")
        hf16 = hf_qwen(path, variant).to("cuda", torch.bfloat16)
        kw = {"mm_processor_kwargs": {"fps": 4}} if variant == "qwen2_5_vl" else {}

        def run(path=path, kw=kw, **more):
            llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                      block_size=16, max_num_batched_tokens=64, **kw, **more)
            enc = llm.engine.mm_encoder
            cases = [(_ids(enc, 8, "v", 100), [], [_frames(4, 84, 112, 101)]),
                     (_ids(enc, 8, "v", 102), [], [_frames(3, 84, 112, 103)]),
                     (_ids(enc, 8, "iv", 104), [smooth_image(100, 40, seed=105)], [_frames(2, 56, 84, 106)]),
                     (_ids(enc, 8, "", 107), [], [])]
            prompts = [{"prompt_token_ids": ids, "multi_modal_data": {**({"image": ims} if ims else {}), "video": vids}}
                       if vids else {"prompt_token_ids": ids} for ids, ims, vids in cases]
            return llm, cases, llm.generate(prompts, GREEDY, use_tqdm=False)

        llm, cases, outs = run()
        assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
        graphed = _tokens(outs)
        assert graphed == _tokens(run(enforce_eager=True)[2])
        assert llm.engine.kv_manager.stats().blocks_used == 0
        if variant == "qwen2_5_vl" and not new_enough:
            continue
        enc = llm.engine.mm_encoder

        def mm_inputs(i, x, cases=cases, enc=enc, hf=hf):
            _, ims, vids = cases[i]
            return hf_inputs(hf, x.cpu(), [enc.pixel_values(im) for im in ims], [enc.video_values(v) for v in vids])

        assert_top_one_agreement(f"{variant} video", hf, hf16, outs, mm_inputs)
        assert llm.engine.kv_manager.stats().blocks_used == 0


def test_video_processor_settings_found_as_transformers_finds_them(qwen, tmp_path):
    """The video bounds: video_preprocessor_config.json's over preprocessor_config.json's
    (which older checkpoints share with images: the tiny one's), processor_config.json's
    nested "video_processor" over both, the class defaults (128 / 768 units) without any;
    tokens_per_second read (Qwen2.5-VL), bad bounds a ConfigError naming the file;
    mm_processor_kwargs bound the frames too."""
    import json
    import shutil

    from flashpage.config import (
        QWEN_VIDEO_MAX_PIXELS,
        QWEN_VIDEO_MIN_PIXELS,
        ConfigError,
        ModelConfig,
    )

    path, _ = qwen("qwen2_5_vl")
    vc = ModelConfig.from_hf(str(path)).vision
    assert (vc.video_processing.min_pixels, vc.video_processing.max_pixels) == (56 * 56, 28 * 28 * 24)
    assert vc.tokens_per_second == 4.0
    d = tmp_path / "q"
    shutil.copytree(path, d)
    (d / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 784,
                                                                           "longest_edge": 28 * 28 * 6}}))
    assert ModelConfig.from_hf(str(d)).vision.video_processing.max_pixels == 28 * 28 * 6
    (d / "processor_config.json").write_text(json.dumps({"video_processor": {"max_pixels": 28 * 28 * 200}}))
    assert ModelConfig.from_hf(str(d)).vision.video_processing.max_pixels == 28 * 28 * 200
    for name in ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json"):
        (d / name).unlink()
    vp = ModelConfig.from_hf(str(d)).vision.video_processing
    assert (vp.min_pixels, vp.max_pixels) == (QWEN_VIDEO_MIN_PIXELS, QWEN_VIDEO_MAX_PIXELS) == (100352, 602112)
    (d / "video_preprocessor_config.json").write_text(json.dumps({"min_pixels": 9000, "max_pixels": 800}))
    with pytest.raises(ConfigError, match="video_preprocessor_config.json.*min_pixels 9000 is above"):
        ModelConfig.from_hf(str(d))
    small = _llm(path, mm_processor_kwargs={"max_pixels": 56 * 56})
    video = small.engine.mm_encoder.admit_video(_frames(2, 84, 112, 110))
    assert video.grid == (1, 2, 4)  # 84 x 112 -> 28 x 56 under 56 x 56 pixels
    with pytest.raises(ConfigError, match="fps must be a positive number"):
        _llm(path, mm_processor_kwargs={"fps": 0})


def test_place_images_puts_video_placeholders_in_order():
    """A template that prints content as a string gets each image's and video's placeholder
    on its own line before the text, in the parts' order; one that loops over parts gets
    {"type": "video"} where the part was."""
    from flashpage.engine.multimodal import place_images

    conv = [{"role": "user", "content": "ab"}]
    parts = [[("text", "a"), ("video", None), ("image", None), ("text", "b")]]
    got = place_images(conv, parts, "{{ message['content'] }}", "<I>", "<V>")
    assert got[0]["content"] == "<V>\n<I>\nab"
    looped = place_images(conv, parts, "{% for c in message['content'] %}{% endfor %}", "<I>", "<V>")
    assert [p["type"] for p in looped[0]["content"]] == ["text", "video", "image", "text"]


def test_prompt_positions_equal_get_rope_index_with_videos(qwen):
    """An image then two videos (grids 2 x 3 x 4 and 3 x 2 x 3 merged) in one prompt:
    transformers' get_rope_index positions and delta (Qwen2-VL; Qwen2.5-VL with
    second_per_grid_ts giving time steps 1 and 0.5), where the two text-after rules agree."""
    from flashpage.engine.mrope import prompt_positions
    from flashpage.engine.multimodal import MultiModalInput

    for variant, steps in (("qwen2_vl", (None, None)), ("qwen2_5_vl", (1.0, 0.5))):
        _, hf = qwen(variant)
        img, vid = hf.config.image_token_id, hf.config.video_token_id
        grids = [(1, 3, 2), (2, 3, 4), (3, 2, 3)]
        ids = [1, 5, 250, *[img] * 6, 252, 7, 250, *[vid] * 24, 252, 8, 9, 250, *[vid] * 18, 252, 10]
        x = torch.tensor([ids])
        types = (x == img).int() + 2 * (x == vid).int()
        kw = {}
        if steps[0] is not None:
            tps = hf.config.vision_config.tokens_per_second
            kw["second_per_grid_ts"] = torch.tensor([s / tps for s in steps])
        ref, delta = hf.model.get_rope_index(x, types, torch.tensor([[1, 6, 4]]),
                                             torch.tensor([[2, 6, 8], [3, 4, 6]]), **kw)
        starts = [3, 12, 40]
        inputs = [MultiModalInput(s, math.prod(g), b"", None, grid=g, time_step=st)
                  for s, g, st in zip(starts, grids, (None, *steps), strict=True)]
        ours, our_delta = prompt_positions(len(ids), inputs)
        assert np.array_equal(ours, ref[:, 0].numpy()) and our_delta == int(delta)
