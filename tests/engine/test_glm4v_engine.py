"""GLM-4.1V image (and video) input through the engine (models/glm4v.py, engine/mrope.py,
M-RoPE on GLM-4's interleaved pairs): the prompt's ids equal transformers' Glm4vProcessor's
(each <|image|> its image's rows; a video's frame groups and their times as its
replace_video_token writes them); greedy tokens equal transformers' generate with the same
patches (one image, two of different sizes, a text-only prompt, in one batch; chunks cutting
through images; a video of three frame groups beside an image); a prefix-cache hit on a
repeated image prompt; LLM.chat's image parts; bad requests refused by name without a leaked
block. fp32, CPU; one CUDA test in bf16 (skipped without a GPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import assert_top_one_agreement
from tests.conftest import count_encodes as _spy
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.glm4v_checkpoint import (
    build_tiny_glm4v,
    glm4v_processor,
    hf_glm4v,
    hf_glm4v_greedy,
    shared_glm4v,
)
from tests.llava_checkpoint import smooth_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SIZES = [(84, 130), (60, 90), (100, 40), (56, 56)]  # 15, 6, 4 and 4 rows


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return shared_glm4v(tmp_path_factory)


def _case(enc, seed: int, n_images: int):
    """(prompt ids with a <|begin_of_image|><|image|><|end_of_image|> per image, the images)."""
    bi, img, ei = enc.placeholder_ids
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 200, (12,), generator=g).tolist()
    ids = [1, *text[:3]]
    for i in range(n_images):
        ids += [bi, img, ei, *text[3 + 2 * i: 5 + 2 * i]]
    ids += text[3 + 2 * n_images:]
    images = [smooth_image(*SIZES[(seed + i) % len(SIZES)], seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _want(hf, llm, out, images=(), videos=(), max_new=MAX_NEW):
    enc = llm.engine.mm_encoder
    return hf_glm4v_greedy(hf, out.prompt_token_ids, [enc.pixel_values(im) for im in images], max_new,
                           [enc.video_values(v) for v in videos])


def _prompts(cases):
    return [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
            for ids, ims in cases]


def test_images_and_text_equal_transformers(glm, monkeypatch):
    """One image, two of different sizes, a text-only prompt, in one batch: the prompts'
    ids Glm4vProcessor's for the same text and images, the tokens transformers'; the same
    batch cut into chunks of 5 tokens (through the images' rows) gives the same tokens."""
    path, hf = glm
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 0, 1), _case(enc, 1, 2), _case(enc, 2, 0)]
    text = "the quick <|begin_of_image|><|image|><|end_of_image|> brown fox <|begin_of_image|><|image|><|end_of_image|>"
    pair = [smooth_image(*SIZES[2], seed=7), smooth_image(*SIZES[0], seed=8)]
    prompts = [*_prompts(cases), {"prompt": text, "multi_modal_data": {"image": pair}}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = [_want(hf, llm, o, ims) for o, ims in zip(outs, [*(ims for _, ims in cases), pair], strict=True)]
    assert _tokens(outs) == want
    n_img = [o.prompt_token_ids.count(enc.config.image_token_id) for o in outs]
    assert n_img == [15, 6 + 4, 0, 4 + 15]  # each <|image|> made its image's rows
    proc = glm4v_processor(path, monkeypatch)
    assert outs[-1].prompt_token_ids == proc(text=[text], images=pair)["input_ids"][0]
    chunked = _llm(path, max_num_batched_tokens=5, enable_prefix_caching=False)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_video_frame_groups_equal_transformers(glm, monkeypatch):
    """A video of 6 frames at 2 fps (3 frame groups, at 0, 1 and 2 s): its <|video|> made each
    group's <|begin_of_image|> rows <|end_of_image|> and its time, as
    Glm4vProcessor.replace_video_token writes them (beside an image too); tokens
    transformers' with the whole video's patches (video_grid_thw (3, h, w)), each group an
    input of its own. (transformers' Glm4vModel masks every <|image|> for the images' rows and
    for the videos' alike, so it takes no prompt holding both: the tokens are compared on the
    video alone.)"""
    from transformers.video_utils import VideoMetadata

    path, hf = glm
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    vc = enc.config
    frames = np.stack([np.asarray(smooth_image(60, 90, seed=40 + i)) for i in range(6)])
    video = (frames, {"fps": 2.0, "frames_indices": list(range(6)), "total_num_frames": 6})
    img = smooth_image(100, 40, seed=3)
    vids = [1, 5, 6, vc.video_start_token_id, vc.video_token_id, vc.video_end_token_id, 7, 8]
    alone = llm.generate([{"prompt_token_ids": vids, "multi_modal_data": {"video": video}}], GREEDY,
                         use_tqdm=False)[0]
    assert _tokens([alone])[0] == _want(hf, llm, alone, videos=[video])
    text = "the <|begin_of_image|><|image|><|end_of_image|> quick <|begin_of_video|><|video|><|end_of_video|> fox"
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": img, "video": video}}], GREEDY,
                       use_tqdm=False)[0]
    assert out.error is None
    proc = glm4v_processor(path, monkeypatch)
    grid = enc.video_values(video).grid
    assert grid == (3, 4, 6)
    md = VideoMetadata(total_num_frames=6, fps=2.0, frames_indices=list(range(6)))
    frames_text = proc.replace_video_token({"video_grid_thw": torch.tensor([list(grid)]), "video_metadata": [md]}, 0)
    assert frames_text.count("<|end_of_image|>") == 3 and frames_text.endswith("<|end_of_image|>2")
    tok = llm.get_tokenizer()
    # the image's rows (its processor's replace_image_token, as test_images_and_text checks)
    want = tok(text.replace("<|image|>", "<|image|>" * 4).replace("<|video|>", frames_text))["input_ids"]
    assert out.prompt_token_ids == want
    assert out.prompt_token_ids.count(vc.image_token_id) == 4 + 3 * 6
    # a prompt given back written out is kept as it is
    again = llm.generate([{"prompt_token_ids": want, "multi_modal_data": {"image": img, "video": video}}], GREEDY,
                         use_tqdm=False)[0]
    assert again.prompt_token_ids == want and _tokens([again]) == _tokens([out])
    ids = tok(text)["input_ids"]
    # no video for its <|video|>, or a video without one: named
    bad = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}},
                        {"prompt_token_ids": [1, *enc.placeholder_ids], "multi_modal_data": {"image": img, "video": video}}],
                       GREEDY, use_tqdm=False)
    assert "1 video token(s) (<|video|>" in bad[0].error and "0 video(s)" in bad[0].error
    assert "0 video token(s)" in bad[1].error and "<|begin_of_video|><|video|><|end_of_video|>" in bad[1].error
    # LLM.chat's video part (frames without metadata: 24 fps, every group at 0 s) where the
    # template puts it
    conv = [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "fox"}]}]
    chat = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    got = chat.prompt_token_ids
    at = got.index(vc.video_start_token_id)
    zero = tok.encode("0", add_special_tokens=False)
    group = [vc.vision_start_token_id, *[vc.image_token_id] * 6, vc.vision_end_token_id, *zero]
    assert got[at:at + 2 + 3 * len(group)] == [vc.video_start_token_id, *group * 3, vc.video_end_token_id]
    assert _tokens([chat])[0] == _want(hf, llm, chat, videos=[frames])


def _video(n: int, seed: int = 40) -> np.ndarray:
    return np.stack([np.asarray(smooth_image(60, 90, seed=seed + i)) for i in range(n)])


def _hf_sampled(path, hf, llm, monkeypatch, text: str, frames, meta: dict, max_duration: float = 300,
                **call) -> tuple[list[int], list[int] | None, list[int]]:
    """(Glm4vProcessor's ids for ``text`` with the video (``frames``, ``meta``), transformers'
    greedy tokens on them (None without ``hf``), the frames it picked): its video processor a
    stand-in (Glm4vVideoProcessor needs torchvision) sampling by transformers' own code
    (BaseVideoProcessor._decode_and_sample_videos with Glm4vVideoProcessor.sample_frames;
    ``max_duration`` its init setting, ``call``'s do_sample_frames / fps the processor call's,
    routed by it) and giving our patches of the frames it picked; its metadata (the picks)
    writes the frame groups' times."""
    import types
    from functools import partial

    from transformers import BatchFeature
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    enc = llm.engine.mm_encoder
    picked: list = []

    class StandIn:
        merge_size = 2

        def __call__(self, videos, **kw):
            own = types.SimpleNamespace(fps=Glm4vVideoProcessor.fps, max_duration=max_duration)
            pick = partial(Glm4vVideoProcessor.sample_frames, own, fps=kw.get("fps"))
            vids, md = BaseVideoProcessor._decode_and_sample_videos(
                types.SimpleNamespace(), videos, video_metadata=kw.get("video_metadata"),
                do_sample_frames=kw.get("do_sample_frames"), sample_indices_fn=pick)
            picked[:] = [(enc.video_values(np.asarray(v)), m.frames_indices.tolist()) for v, m in zip(vids, md, strict=True)]
            return BatchFeature({"video_grid_thw": torch.tensor([list(v.grid) for v, _ in picked]),
                                 "video_metadata": md})

    proc = glm4v_processor(path, monkeypatch)
    proc.video_processor = StandIn()
    ids = proc(text=[text], videos=[frames], video_metadata=[meta], **call)["input_ids"][0]
    tokens = None if hf is None else hf_glm4v_greedy(hf, ids, None, MAX_NEW, [v for v, _ in picked])
    return ids, tokens, picked[0][1]


def test_frame_sampling_equals_transformers(glm, monkeypatch, tmp_path):
    """Glm4vVideoProcessor's do_sample_frames (models/glm4v_video.py) asked per request: 30
    frames at 10 fps sampled at 2 a second (no duration given: 4 s from the count; frames 0,
    5, ..., 25, 29 and 29 again, four groups at 0, 1, 2 and 2 s) and at 1.5 a second over 3 s
    (0, 7 | 14, 20: two groups at 0 and 1 s): Glm4vProcessor's ids (transformers' own picks
    and times) and its greedy tokens. Asked by the video processor's file (max_duration 2
    under the 3 s video: 4 frames over it, 0, 10, 20, 29): Glm4vProcessor's ids with that
    setting, and the tokens of those frames given as they are; a request's do_sample_frames
    false takes the frames as given. Refused by name beside good requests: a video without
    fps, picks a sampled video lacks, a bad fps, a key transformers' call ignores."""
    import json
    import shutil

    path, hf = glm
    llm = _llm(path)
    text = "watch <|begin_of_video|><|video|><|end_of_video|> now"
    v30 = _video(30)
    m30 = {"fps": 10.0, "total_num_frames": 30}
    m3s = {**m30, "duration": 3.0}
    k2, k15 = {"do_sample_frames": True}, {"do_sample_frames": True, "fps": 1.5}
    want = [_hf_sampled(path, hf, llm, monkeypatch, text, v30, m30, **k2),
            _hf_sampled(path, hf, llm, monkeypatch, text, v30, m3s, **k15)]
    assert [picks for _, _, picks in want] == [[0, 5, 10, 15, 20, 25, 29, 29], [0, 7, 14, 20]]
    tok = llm.get_tokenizer()
    times = [re.findall(r"<\|end_of_image\|>\s*(\d+)", tok.decode(ids)) for ids, _, _ in want]
    assert times == [["0", "1", "2", "2"], ["0", "1"]]
    sampled = (v30[::3], {**m30, "frames_indices": list(range(0, 30, 3))})  # a file sampled already
    bad = [({"video": v30}, k2, "video 0: do_sample_frames picks frames by the video's fps (2 a second of it), "
            "but its metadata gives none"),
           ({"video": sampled}, k2, "video 0: do_sample_frames picks frame(s) [5, 10, 20, 25, 29] of its 30, which it "
            "does not hold"),
           ({"video": (v30, m30)}, {**k2, "fps": 0}, "mm_processor_kwargs: fps must be a positive number, got 0"),
           ({"video": (v30, m30)}, {**k2, "max_duration": 2}, "mm_processor_kwargs ['max_duration']")]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"video": (v30, m30)}, "mm_processor_kwargs": k2},
                         *({"prompt": text, "multi_modal_data": d, "mm_processor_kwargs": k} for d, k, _ in bad),
                         {"prompt": text, "multi_modal_data": {"video": (v30, m3s)}, "mm_processor_kwargs": k15}],
                        GREEDY, use_tqdm=False)
    assert [outs[0].prompt_token_ids, outs[-1].prompt_token_ids] == [ids for ids, _, _ in want]
    assert _tokens([outs[0], outs[-1]]) == [t for _, t, _ in want]
    for out, (_, _, needle) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and needle in out.error, out.error
    assert llm.engine.kv_manager.stats().blocks_used == 0
    # the video processor's file asks (its pixel bounds the image processor's, as the tiny
    # checkpoint's videos take them): no request's kwargs needed
    folder = tmp_path / "sampled"
    shutil.copytree(path, folder)
    size = json.loads((path / "preprocessor_config.json").read_text())["size"]
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Glm4vVideoProcessor", "size": size, "do_sample_frames": True, "max_duration": 2}))
    ids, _, picks = _hf_sampled(path, None, llm, monkeypatch, text, v30, m3s, max_duration=2, do_sample_frames=True)
    assert picks == [0, 10, 20, 29]
    outs = _llm(folder).generate([{"prompt": text, "multi_modal_data": {"video": (v30, m3s)}},
                                  {"prompt": text, "multi_modal_data": {"video": (v30, m3s)},
                                   "mm_processor_kwargs": {"do_sample_frames": False}}], GREEDY, use_tqdm=False)
    # the engine on transformers' picks given as they are (frames as given are transformers':
    # test_video_frame_groups_equal_transformers)
    given = llm.generate([{"prompt": text, "multi_modal_data": {"video": (v30[picks], {**m3s, "frames_indices": picks})}},
                          {"prompt": text, "multi_modal_data": {"video": (v30, m3s)}}], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids == given[0].prompt_token_ids and _tokens(outs[:1]) == _tokens(given[:1])
    assert outs[1].prompt_token_ids == given[1].prompt_token_ids != ids
    assert _tokens(outs[1:]) == _tokens(given[1:])


def test_prefix_cache_hits_on_a_repeated_image(glm, monkeypatch):
    """The same prompt and image again: every block hit but the last, the tower not run; the
    same text before another image: only the blocks before the image's hit."""
    path, hf = glm
    llm = _llm(path, mm_encoder_cache_tokens=0)  # the tower runs again wherever the prefix cache misses
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    encoded = _spy(monkeypatch, enc)
    img = smooth_image(*SIZES[0], seed=5)  # 15 rows
    ids = [1, 5, 6, 7, 8, 9, 10, 11, 12, *enc.placeholder_ids, *range(40, 56)]

    def run(image):
        return llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], GREEDY,
                            use_tqdm=False)[0]

    first = run(img)
    assert _tokens([first])[0] == _want(hf, llm, first, [img])
    hits = kv.prefix_hits
    again = run(img)
    n = len(first.prompt_token_ids)
    assert _tokens([again]) == _tokens([first])
    assert kv.prefix_hits - hits == (n - 1) // 8 * 8 and encoded == [1]
    hits = kv.prefix_hits
    other_img = smooth_image(*SIZES[0], seed=6)
    other = run(other_img)  # the first block (ids 0 .. 7) is text alone: shared
    assert kv.prefix_hits - hits == 8 and encoded == [1, 1]
    assert _tokens([other])[0] == _want(hf, llm, other, [other_img]) != _tokens([first])[0]
    assert kv.stats().blocks_used == 0


def test_bad_requests_are_refused_by_name_and_leak_nothing(glm):
    path, hf = glm
    llm = _llm(path, max_model_len=64)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    enc = llm.engine.mm_encoder
    ids, (img,) = _case(enc, 50, 1)
    pad, video = enc.config.image_token_id, enc.config.video_token_id
    plain = [t for t in ids if t != pad]
    bad = [
        ({"prompt_token_ids": plain, "multi_modal_data": {"image": img}},
         ["0 image token(s)", "1 image(s)", "<|begin_of_image|><|image|><|end_of_image|>"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}}, ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids}, ["<|image|>", "no image was given"]),
        ({"prompt_token_ids": [1, video, 5]}, ["<|video|>", "no video was given"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": smooth_image(10, 2500)}}, ["aspect ratio"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 28, 28)}}, ["uint8", "float32"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": np.zeros((1, 56, 56, 3), np.uint8)}},
         ["video 0 could not be read", "at least temporal_patch_size (2) frames"]),
        ({"prompt_token_ids": ids + [5] * 60, "multi_modal_data": {"image": img}}, ["max_model_len is 64"]),
    ]
    good = _case(enc, 51, 1)
    batch = [_prompts([good])[0], *(b for b, _ in bad), plain]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens([outs[0], outs[-1]]) == [_want(hf, llm, outs[0], good[1]), _want(hf, llm, outs[-1])]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_mm_processor_kwargs_size_bounds_the_pixels(glm):
    """vLLM's mm_processor_kwargs in transformers' form, {"size": {"shortest_edge",
    "longest_edge"}}, read as Glm4vImageProcessor reads them (over the image as 2 frames): an
    84 x 130 image (15 rows at the checkpoint's bounds) under 2 x 56 x 84 pixels is resized
    to 28 x 84, 3 rows, as Glm4vImageProcessorPil with that size makes it; transformers' tokens
    on those patches."""
    import transformers

    path, hf = glm
    size = {"shortest_edge": 2 * 28 * 28, "longest_edge": 2 * 56 * 84}
    small = _llm(path, mm_processor_kwargs={"size": size})
    enc = small.engine.mm_encoder
    ids, (img,) = _case(enc, 0, 1)
    out = small.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY,
                         use_tqdm=False)[0]
    assert out.prompt_token_ids.count(enc.config.image_token_id) == 3
    assert transformers.Glm4vImageProcessorPil(size=size)(img)["image_grid_thw"][0].tolist() == [1, 2, 6]
    assert _tokens([out])[0] == _want(hf, small, out, [img])


def test_llm_chat_places_images_as_glms_template(glm):
    """LLM.chat with an image_pil part: <|begin_of_image|><|image|> x rows <|end_of_image|>
    where the part is, the tokens transformers'."""
    path, hf = glm
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    img = smooth_image(*SIZES[1], seed=9)
    conv = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_pil", "image_pil": img}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    bi, pad, ei = enc.placeholder_ids
    got = out.prompt_token_ids
    at = got.index(bi)
    assert got[at:at + 8] == [bi, *[pad] * 6, ei]
    assert llm.get_tokenizer().decode(got[:at]).endswith("look")
    assert _tokens([out])[0] == _want(hf, llm, out, [img])


def test_glm45v_moe_images_and_text_equal_transformers(tmp_path):
    """GLM-4.5V (Glm4vMoeForConditionalGeneration): the same tower over GLM-4.5's MoE text
    model (a dense first layer, then sigmoid-routed experts in groups with a correction bias
    and a shared expert; M-RoPE on halves): one image, two of different sizes and a text-only
    prompt in one batch, transformers' tokens."""
    path = build_tiny_glm4v(tmp_path / "glm45v", moe=True)
    hf = hf_glm4v(path)
    llm = _llm(path)
    mc = llm.engine.model_config
    assert (mc.architecture, mc.rope_interleaved, mc.n_routed_experts, mc.first_k_dense_replace) == \
        ("Glm4MoeForCausalLM", False, 8, 1)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 3, 1), _case(enc, 1, 2), _case(enc, 2, 0)]
    outs = llm.generate(_prompts(cases), GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims) for o, (_, ims) in zip(outs, cases, strict=True)]
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_triton_backend_fused_rotary_in_the_interpreter(glm):
    """The triton backend (its rotary fused with the K/V write on interleaved pairs, 3-D
    positions as a per-token cos / sin table) on the CPU's interpreter: an image request cut
    into two chunks (inside the image's rows), transformers' tokens."""
    path, hf = glm
    llm = _llm(path, attention_backend="triton", max_num_batched_tokens=8)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 41, 1)]  # 6 rows at positions 5 .. 10 of 21: chunks 0-7, 8-15, 16-20
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(_prompts(cases), params, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, outs[0], cases[0][1], max_new=3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("moe", [False, True], ids=["glm4.1v", "glm4.5v"])
def test_glm4v_on_the_gpu_with_graphs_bf16(tmp_path, moe):
    """bf16 on CUDA (triton backend: the fused rotary with 3-D positions' per-token tables,
    on interleaved pairs for GLM-4.1V, halves for GLM-4.5V's MoE text model; CUDA graphs
    captured; the tower's rotary / RMSNorm / SiLU-mul kernels): tokens equal an eager
    engine's; against transformers on the GPU, teacher-forced on our tokens, our token is
    fp32's top one about as often as transformers' own bf16 top token is (within 3 points,
    and at least 85%, as the Qwen2-VL test asks; each request's tokens up to one that is the
    image token, which transformers would take for an image row)."""
    path = build_tiny_glm4v(tmp_path / "glm4v", moe=moe, text=dict(  # GLM-4.1V's heads: 128 wide, 64 rotated
        num_attention_heads=2, num_key_value_heads=1, hidden_size=256, intermediate_size=512, head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                         "partial_rotary_factor": 0.5}, **(dict(moe_intermediate_size=64) if moe else {})))
    hf = hf_glm4v(path).to("cuda")
    hf16 = hf_glm4v(path).to("cuda", torch.bfloat16)

    # 24 requests of 16 tokens: the two agreements are estimates whose difference swings
    # with few tokens (GLM-4.1V's model in bf16 on the CPU, over five sets of prompts: -4.1
    # to +5.2 points over 96 tokens, -2.6 to +1.6 over 192; -1.3 and +1.4 over 384)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                  block_size=16, max_num_batched_tokens=64, **kw)
        enc = llm.engine.mm_encoder
        cases = [_case(enc, 60 + i, i % 3) for i in range(24)]
        return llm, cases, llm.generate(_prompts(cases), params, use_tqdm=False)

    llm, cases, outs = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    mc = llm.engine.model_config
    assert (mc.head_dim, mc.rotary_dim, mc.rope_interleaved) == (128, 64, not moe)
    graphed = _tokens(outs)
    assert graphed == _tokens(run(enforce_eager=True)[2])
    enc = llm.engine.mm_encoder

    def mm_inputs(i, x):
        px = [enc.pixel_values(im) for im in cases[i][1]]
        if not px:
            return {}
        return dict(pixel_values=torch.cat([p.patches for p in px]),
                    image_grid_thw=torch.tensor([list(p.grid) for p in px]),
                    mm_token_type_ids=(x == enc.config.image_token_id).int())

    assert_top_one_agreement("glm4.5v" if moe else "glm4.1v", hf, hf16, outs, mm_inputs,
                             cut_at=(enc.config.image_token_id,))
    assert llm.engine.kv_manager.stats().blocks_used == 0
