"""InternVL video input through the engine (models/internvl.py: a prompt's <video> made each
frame's "FrameN: <img>...</img>" text before tokenizing, as InternVLProcessor does; each frame
one tile). Greedy tokens equal transformers' InternVLForConditionalGeneration.generate on the
ids its InternVLProcessor makes (its own text expansion and image / video ordering; its video
processor needs torchvision, which the CPU image lacks: a stand-in hands it our resized
frames, normalized under the checkpoint's video processor's mean and std, here CLIP's beside
the images' ImageNet ones) for a video alone, an image and a video either way round, two
videos and a text prompt, whole and in steps of 16 tokens; frames written out in token ids;
LLM.chat's video parts; the remote-code layout (vLLM's form: frames joined without a newline); a repeated video hits
the prefix cache; bad video requests are refused by name beside a good one, leaking nothing.
fp32, CPU; one bf16 CUDA test."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from flashpage import LLM, SamplingParams
from flashpage.config import ImageProcessing
from flashpage.models.clip_image import normalize
from flashpage.models.internvl import InternVLImage, expand_video_text, tile_image, video_frames
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.internvl_checkpoint import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ROWS,
    TILE,
    build_tiny_internvl,
    hf_internvl,
    hf_internvl_greedy,
    hf_processor,
    to_remote_layout,
)
from tests.llava_checkpoint import smooth_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny InternVL whose video processor normalizes with CLIP's mean and std (its image
    processor with ImageNet's), so a frame normalized as an image would show."""
    path = build_tiny_internvl(tmp_path_factory.mktemp("ivl_video"),
                               video_processor={"image_mean": CLIP_MEAN, "image_std": CLIP_STD})
    return path, hf_internvl(path)


def _video(n: int, h: int = 20, w: int = 24, seed: int = 0) -> np.ndarray:
    """A smooth uint8 video (T, H, W, 3)."""
    return np.stack([np.asarray(smooth_image(h, w, seed=seed * 10 + i)) for i in range(n)])


def _frame_pixels(video, vc, mean, std) -> torch.Tensor:
    """A video's frames resized as ours (the video processor's resize is torchvision's),
    normalized under ``mean`` / ``std``: [F, 3, S, S] fp32."""
    proc = ImageProcessing(None, (TILE, TILE), None, 1 / 255, tuple(mean), tuple(std))
    return normalize(video_frames(video, vc), proc)


def _image_pixels(image, vc) -> torch.Tensor:
    proc = ImageProcessing(None, (TILE, TILE), None, 1 / 255, tuple(IMAGENET_MEAN), tuple(IMAGENET_STD))
    return normalize(tile_image(image, vc).pixels, proc)


def _hf_tokens(path, hf, vc, text: str, images: list, videos: list, max_new: int = MAX_NEW, **call
               ) -> tuple[list[int], list[int]]:
    """(transformers' InternVLProcessor ids for ``text`` with ``images`` and ``videos``, its
    model's greedy tokens on them). The processor's pixel_values (GotOcr2's tiles, the
    stand-in's frames, in its prompt order) are checked against ours in the text's order
    (images' within two uint8 levels), which then go to generate."""
    from transformers import BatchFeature

    frames = [_frame_pixels(v, vc, CLIP_MEAN, CLIP_STD) for v in videos]
    proc = hf_processor(path)
    # its videos stacked, as its processor's call needs (one frame count for all)
    proc.video_processor = lambda videos, **kw: BatchFeature({"pixel_values_videos": torch.stack(frames)})
    out = proc(text=[text], images=images or None, videos=videos or None, return_tensors="pt", **call)
    ids = out["input_ids"][0].tolist()
    im, vi = iter(images), iter(frames)
    ours = [_image_pixels(next(im), vc) if m.group() == "<IMG_CONTEXT>" else next(vi)
            for m in re.finditer(r"<IMG_CONTEXT>|<video>", text)]
    if not ours:
        return ids, hf_internvl_greedy(hf, ids, [], max_new)
    px = torch.cat(ours)
    assert torch.allclose(out["pixel_values"].float(), px, atol=2.5 / 255 / min(IMAGENET_STD)), "pixel order"
    return ids, hf_internvl_greedy(hf, ids, [InternVLImage(px, (TILE, TILE), px.shape[0] * ROWS)], max_new)


def _cases():
    """(text, images, videos, the multi_modal_data as given): a video alone (array), an image
    then a video (a list of PIL frames), a video (a tensor) then an image, two videos, text."""
    img, small = smooth_image(20, 40, seed=3), smooth_image(16, 16, seed=4)
    v3, v2, v4 = _video(3, seed=1), _video(2, 30, 18, seed=2), _video(4, 16, 16, seed=3)
    a, b = _video(2, seed=5), _video(2, 12, 40, seed=6)
    pil = [Image.fromarray(f) for f in v2]
    return [
        ("the cat <video> runs fast", [], [v3], {"video": v3}),
        ("see <IMG_CONTEXT>\nand then <video>\nwhat", [img], [v2], {"image": img, "video": pil}),
        ("<video> first, then <IMG_CONTEXT> x", [small], [v4], {"image": [small], "video": torch.from_numpy(v4)}),
        ("one <video> two <video> end", [], [a, b], {"video": [a, b]}),
        ("just some text here", [], [], None),
    ]


def _prompts(cases):
    return [{"prompt": t, **({"multi_modal_data": d} if d is not None else {})} for t, _, _, d in cases]


def test_videos_equal_transformers_whole_and_chunked(ckpt):
    """Each <video> becomes its frames' "FrameN: <img>...</img>" lines (the processor's ids,
    tokenized with the text around them), each frame 16 rows normalized under the video
    processor's mean and std; then the same batch in steps of 16 tokens, each frame and
    image through the tower once; no block left behind."""
    path, hf = ckpt
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    cases = _cases()
    want = [_hf_tokens(path, hf, vc, t, ims, vids) for t, ims, vids, _ in cases]
    outs = llm.generate(_prompts(cases), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids for ids, _ in want]
    assert _tokens(outs) == [t for _, t in want]
    assert outs[0].prompt == cases[0][0]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    chunked = _llm(path, max_num_batched_tokens=16)
    enc = chunked.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    assert _tokens(chunked.generate(_prompts(cases), GREEDY, use_tqdm=False)) == [t for _, t in want]
    assert sum(encoded) == (3 + 2 + 4 + 2 + 2) + 2  # each frame and image once
    assert chunked.engine.kv_manager.stats().blocks_used == 0


def test_frames_written_out_in_token_ids(ckpt):
    """Token ids with each video's frames written out as the processor writes them (its own
    ids) give the text prompt's tokens, the video as an array or a (frames, metadata) pair;
    an image beside them as one <IMG_CONTEXT>."""
    path, hf = ckpt
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    text, _, (video,), _ = _cases()[0]
    ids, want = _hf_tokens(path, hf, vc, text, [], [video])
    img = smooth_image(20, 40, seed=3)
    mixed = llm.get_tokenizer().encode(expand_video_text("an <IMG_CONTEXT> and a <video> then", vc, [3]))
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"video": video}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"video": (video, {"fps": 2.0})}},
                         {"prompt_token_ids": mixed, "multi_modal_data": {"image": img, "video": video}},
                         {"prompt": "an <IMG_CONTEXT> and a <video> then",
                          "multi_modal_data": {"image": img, "video": video}}], GREEDY, use_tqdm=False)
    assert _tokens(outs[:2]) == [want, want]
    assert _tokens(outs[2:3]) == _tokens(outs[3:]) and outs[2].prompt_token_ids == outs[3].prompt_token_ids


def test_chat_video_parts(ckpt):
    """LLM.chat's {"type": "video", "video": frames} parts (an array, a list of PIL frames)
    beside an image part: the template's <video> written out into the rendered text and
    tokenized with it; the processor's ids (its call on the rendered text, no special tokens
    added, as its apply_chat_template) and transformers' tokens."""
    path, hf = ckpt
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    img, video = smooth_image(20, 40, seed=9), _video(2, 30, 18, seed=10)
    conv = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                         {"type": "video", "video": [Image.fromarray(f) for f in video]},
                                         {"type": "text", "text": "what happens?"}]}]
    rendered = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "what happens?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert "<IMG_CONTEXT>\n<video>\nwhat happens?" in rendered
    ids, want = _hf_tokens(path, hf, vc, rendered, [img], [video], add_special_tokens=False)
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert _tokens([out]) == [want]


def test_remote_layout_takes_videos_as_vllm_does(ckpt, tmp_path):
    """OpenGVLab's layout (InternVLChatModel): a text prompt's "<video>" becomes its frames'
    "FrameN: <img>...</img>" joined without a newline (vLLM's form for it), the frames
    normalized as its images (its chat code's transform); "<image>" beside it; transformers'
    tokens on the converted weights."""
    path, hf = ckpt
    remote = _llm(to_remote_layout(path, tmp_path / "remote"))
    vc = remote.engine.mm_encoder.config
    assert (vc.frame_sep, vc.video_token_id, vc.video_processing) == ("", None, None)
    img, video = smooth_image(20, 40, seed=7), _video(3, seed=8)
    text = "look <image>\nthen <video>\nsay"
    tile = "<img>" + "<IMG_CONTEXT>" * ROWS + "</img>"
    written = text.replace("<image>", "<img>" + "<IMG_CONTEXT>" * 3 * ROWS + "</img>").replace(
        "<video>", "".join(f"Frame{i + 1}: {tile}" for i in range(3)))
    ids = remote.get_tokenizer().encode(written)
    px = torch.cat([_image_pixels(img, vc), _frame_pixels(video, vc, IMAGENET_MEAN, IMAGENET_STD)])
    want = hf_internvl_greedy(hf, ids, [InternVLImage(px, (TILE, TILE), px.shape[0] * ROWS)], MAX_NEW)
    out = remote.generate([{"prompt": text, "multi_modal_data": {"image": img, "video": video}}], GREEDY,
                          use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert _tokens([out]) == [want]


def test_repeated_video_hits_the_prefix_cache(ckpt):
    """The same video again (another array of the same frames) reuses the first's blocks and
    the tower does not run; a video with its last frame changed shares the text blocks
    before the video only (the prefix-cache chain names all of a prompt's inputs), and its
    two unchanged frames' rows come from the encoder cache (each frame an input): the tower
    runs on one frame."""
    path, hf = ckpt
    llm = _llm(path)
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    text, video = "once upon a time the big cat <video> runs fast", _video(3, seed=1)

    def run(v):
        return llm.generate([{"prompt": text, "multi_modal_data": {"video": v}}], GREEDY, use_tqdm=False)[0]

    first = run(video)
    n = len(first.prompt_token_ids)
    hits = kv.prefix_hits
    assert _tokens([run(video.copy())]) == _tokens([first])
    assert kv.prefix_hits - hits == (n - 1) // 8 * 8
    assert encoded == [3]
    other = video.copy()
    other[2] = 255 - other[2]
    hits = kv.prefix_hits
    changed = run(other)
    first_row = changed.prompt_token_ids.index(enc.config.start_token_id) + 1
    assert first_row >= 8 and kv.prefix_hits - hits == first_row // 8 * 8
    assert encoded == [3, 1]
    vc = enc.config
    assert _tokens([changed]) == [_hf_tokens(path, hf, vc, text, [], [other])[1]]
    assert kv.stats().blocks_used == 0


def test_bad_video_requests_are_refused_by_name_and_leak_nothing(ckpt):
    path, hf = ckpt
    llm = _llm(path, limit_mm_per_prompt={"video": 1})
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    vc = llm.engine.mm_encoder.config
    video = _video(3, seed=1)
    ids = llm.get_tokenizer().encode("the cat <video> runs")
    written = llm.get_tokenizer().encode(expand_video_text("the cat <video> runs", vc, [2]))
    img = smooth_image(16, 16, seed=2)
    wide = smooth_image(20, 40, seed=2)  # 3 tiles
    both = llm.get_tokenizer().encode(expand_video_text("an <IMG_CONTEXT> and <video>", vc, [3]))
    at = both.index(vc.image_token_id)
    both[at:at + 1] = [vc.image_token_id] * (3 * ROWS)  # the image expanded already (<img> / </img> wrap it)
    both[at:at] = [vc.start_token_id]
    both.insert(at + 1 + 3 * ROWS, vc.end_token_id)
    bad = [
        ({"prompt": "a <video> b", "multi_modal_data": {"video": np.zeros((0, 20, 24, 3), np.uint8)}},
         ["video 0 has no frames"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": video.astype(np.float32)}},
         ["video 0: frames must be uint8 (T, H, W, 3), got float32 [3, 20, 24, 3]"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": [video, video]}},
         ["the prompt has 1 video placeholder(s) (<video>) but 2 video(s) were given"]),
        ({"prompt": "a <video> b <video>", "multi_modal_data": {"video": [video, video]}},
         ["2 video item(s) in one prompt, but limit_mm_per_prompt allows 1"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"video": [np.asarray(img), np.zeros((8, 8, 3), np.uint8)]}},
         ["video 0: its frames differ in size"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": video}},
         ["ids hold <video> (id", "not expanded in token ids", "give the prompt as text"]),
        ({"prompt_token_ids": written, "multi_modal_data": {"video": video}},
         ["the prompt has 2 video frame(s) and 0 image token(s)", "but 3 frame(s) (the videos') and 0 image(s)"]),
        ({"prompt_token_ids": both, "multi_modal_data": {"image": wide, "video": video}},
         [f"a run of {3 * ROWS} <IMG_CONTEXT>", "an image is one <IMG_CONTEXT>"]),
        ({"prompt_token_ids": [1, 5, 6, 7], "multi_modal_data": {"video": video}},
         ["the prompt has 0 video frame(s)", "in token ids write them out"]),
        ({"prompt": "a <video> b", "multi_modal_data": {"image": img}},
         ["the prompt has video tokens (<video>, id", "but no video was given"]),
        ({"prompt_token_ids": ids}, ["the prompt has video tokens (<video>, id", "but no video was given"]),
    ]
    good = _cases()[0]
    batch = [_prompts([good])[0], *(b for b, _ in bad)]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1]) == [_hf_tokens(path, hf, vc, good[0], [], good[2])[1]]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_video_limits(ckpt):
    """limit_mm_per_prompt {"image": 0} keeps the tower for videos (a video runs, an image is
    refused by the limit); {"image": 0, "video": 0} serves the text model alone."""
    path, hf = ckpt
    llm = _llm(path, limit_mm_per_prompt={"image": 0})
    assert llm.engine.mm_encoder is not None
    text, _, vids, data = _cases()[0]
    outs = llm.generate([{"prompt": text, "multi_modal_data": data},
                         {"prompt": "an <IMG_CONTEXT>", "multi_modal_data": {"image": smooth_image(16, 16)}}],
                        GREEDY, use_tqdm=False)
    assert _tokens(outs[:1]) == [_hf_tokens(path, hf, llm.engine.mm_encoder.config, text, [], vids)[1]]
    assert "1 image item(s) in one prompt, but limit_mm_per_prompt allows 0" in outs[1].error
    assert _llm(path, limit_mm_per_prompt={"image": 0, "video": 0}).engine.mm_encoder is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_internvl_video_on_the_gpu_bf16(tmp_path):
    """bf16 on CUDA (triton backend, graphs captured): the video cases' tokens equal an eager
    engine's, and their prompts the fp32 CPU engine's ids."""
    path = build_tiny_internvl(tmp_path / "ivl64", text_fields=dict(hidden_size=128, num_attention_heads=2,
                                                                         num_key_value_heads=1))

    def llm16(**kw) -> LLM:
        return LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                   max_num_batched_tokens=128, **kw)

    prompts = _prompts(_cases())
    graphed = llm16().generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(graphed) == _tokens(llm16(enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    cpu = _llm(path).generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.prompt_token_ids for o in graphed] == [o.prompt_token_ids for o in cpu]
