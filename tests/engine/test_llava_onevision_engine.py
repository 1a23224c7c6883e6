"""LLaVA-OneVision image input through the engine (models/llava_onevision.py on
engine/multimodal.py): greedy tokens equal transformers'
LlavaOnevisionForConditionalGeneration.generate for an image alone whose grid is pooled
(anyres_max) and one whose is not, two images of different sizes in one prompt (one tile
each), a text-only prompt beside them, chunked prefill cutting an image's rows; a repeated
image hits the prefix cache; videos (frames pooled 2 x 2, one newline) alone, beside an
image and cut by chunked prefill equal transformers' too; bad requests are refused by name
and leak nothing. fp32, CPU; one bf16 CUDA test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flashpage import LLM, SamplingParams
from flashpage.models.clip_image import normalize
from flashpage.models.llava_next import AnyResImage, anyres_pixels
from flashpage.models.llava_onevision import single_tile_pixels, video_frames
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.conftest import random_prompts
from tests.llava_checkpoint import smooth_image
from tests.llava_onevision_checkpoint import (
    build_tiny_llava_onevision,
    hf_inputs,
    hf_llava_onevision,
    hf_llava_onevision_greedy,
)

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# (height, width): 3 x 3 tiles (pooled), 1 x 2, tall, square 2 x 2, 2 x 3 (pooled)
SIZES = [(45, 40), (20, 33), (45, 18), (30, 30), (30, 45)]


@pytest.fixture(scope="module")
def ov_ckpt(tmp_path_factory):
    path = build_tiny_llava_onevision(tmp_path_factory.mktemp("llava_ov"))
    hf = hf_llava_onevision(path)
    return path, hf, hf.config.image_token_index


def _case(tok: int, seed: int, n_images: int, before: int = 4, after: int = 5, first: int | None = None):
    """(prompt ids with n <image> placeholders, the images: sizes from SIZES)."""
    text = [t % 200 + 3 for t in random_prompts(1, before + after, before + after, seed=seed)[0]]
    ids = [1, *text[:before]]
    for i in range(n_images):
        ids += [tok, *text[before + i: before + i + 2]]
    ids += text[before + n_images * 2:]
    k = seed if first is None else first
    images = [smooth_image(*SIZES[(k + i) % len(SIZES)], seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _items(images, vc) -> list[AnyResImage]:
    """The images as transformers' processor makes them for one prompt: tiled when alone,
    one tile each when several."""
    if len(images) == 1:
        return [anyres_pixels(images[0], vc)]
    return [single_tile_pixels(im, vc) for im in images]


def _expanded(ids, tok, items) -> list[int]:
    out: list[int] = []
    k = 0
    for t in ids:
        if t == tok:
            out += [tok] * items[k].rows
            k += 1
        else:
            out.append(t)
    return out


def _video_expanded(ids, tok, vtok, items, video) -> list[int]:
    """``ids`` with each <image> and the <video> made their rows."""
    return [x for t in _expanded(ids, tok, items) for x in ([vtok] * video.rows if t == vtok else [t])]


def _video_kw(hf, vc, items, video) -> dict:
    """transformers' inputs for a prompt's images (our AnyResImage's) and one video."""
    dev = hf.device
    px = normalize(video.frames, vc.processing)[None].to(dev, hf.dtype)
    return {**hf_inputs(hf, items), "pixel_values_videos": px}


def _want_video(hf, ids, items, video, vc, max_new=MAX_NEW):
    """transformers' greedy tokens for ``ids`` with images ``items`` and one ``video``."""
    tok, vtok = hf.config.image_token_index, hf.config.video_token_index
    exp = _video_expanded(ids, tok, vtok, items, video)
    dev = hf.device
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([exp], device=dev),
                          attention_mask=torch.ones(1, len(exp), dtype=torch.long, device=dev),
                          max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                          **_video_kw(hf, vc, items, video))
    return out[0, len(exp):].tolist()


def _want(hf, tok, ids, images, llm, max_new=MAX_NEW):
    """transformers' tokens for ``ids`` with each <image> expanded to its image's rows."""
    items = _items(images, llm.engine.mm_encoder.config)
    return hf_llava_onevision_greedy(hf, _expanded(ids, tok, items), items, max_new)


def test_images_equal_transformers_whole_and_chunked(ov_ckpt):
    """An image alone pooled, one alone not, two of different sizes in one prompt, a
    text-only prompt, in one batch; then the same batch cut into steps of 16 tokens (each
    image's rows split across steps), each image through the tower once."""
    path, hf, tok = ov_ckpt
    cases = [_case(tok, 1, 1, first=0), _case(tok, 2, 1, first=1), _case(tok, 3, 2, first=2),
             (_case(tok, 4, 0)[0], [])]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    want = [_want(hf, tok, ids, ims, llm) for ids, ims in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    pooled, plain = _items(cases[0][1], vc)[0], _items(cases[1][1], vc)[0]
    # 3 x 3 tiles: 12 x 12 rows unpadded to 12 x 10, pooled to 8 x 7; 2 x 3 tiles: 8 x 12
    # unpadded to 5 x 11, kept (55 rows: under 1.1^2 x 4 tiles' 64)
    assert pooled.rows == 16 + 8 * 8 and plain.rows == 16 + 5 * 12
    assert len(outs[2].prompt_token_ids) == len(cases[2][0]) - 2 + 2 * 17  # one tile + newline each
    assert llm.engine.kv_manager.stats().blocks_used == 0
    chunked = _llm(path, max_num_batched_tokens=16)
    enc = chunked.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert sum(encoded) == 4  # each image once
    assert chunked.engine.kv_manager.stats().blocks_used == 0


def test_prefix_cache_hit_on_a_repeated_image(ov_ckpt):
    """The same image again (another PIL object of the same pixels) hits the first's blocks
    and its tower does not run; another image of the same size hits nothing; the same
    image as one of two is other rows (one tile), and hits nothing after the text."""
    path, hf, tok = ov_ckpt
    llm = _llm(path)
    kv = llm.engine.kv_manager
    ids, (img,) = _case(tok, 5, 1, before=6, after=12, first=0)
    other = smooth_image(img.size[1], img.size[0], seed=77)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)

    def run(image):
        return _tokens(llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}],
                                    GREEDY, use_tqdm=False))[0]

    first = run(img)
    assert first == _want(hf, tok, ids, [img], llm)
    n_prompt = len(ids) - 1 + anyres_pixels(img, enc.config).rows
    hits = kv.prefix_hits
    assert run(img.copy()) == first
    assert kv.prefix_hits - hits == (n_prompt - 1) // 8 * 8  # every full block but a last token's
    assert encoded == [1]
    hits = kv.prefix_hits
    assert run(other) == _want(hf, tok, ids, [other], llm)
    assert kv.prefix_hits == hits
    assert kv.stats().blocks_used == 0


def test_bad_requests_are_refused_by_name_and_leak_nothing(ov_ckpt):
    path, hf, tok = ov_ckpt
    llm = _llm(path, max_model_len=120)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    ids, (img,) = _case(tok, 6, 1, first=1)
    good = _case(tok, 7, 2)
    big = smooth_image(45, 40, seed=1)  # 88 rows: past max_model_len with the text
    vc = llm.engine.mm_encoder.config
    tile = single_tile_pixels(img, vc)
    bad = [
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": [img, img]}},
         ["0 video token(s) (<video>, id 241) and 1 image token(s) but 1 video(s) and 0 image(s)"]),
        ({"prompt_token_ids": [*ids, 241], "multi_modal_data": {"image": img, "video": torch.zeros(2, 8, 8, 3)}},
         ["video 0: frames must be uint8 (T, H, W, 3), got float32 [2, 8, 8, 3]"]),
        ({"prompt_token_ids": [1, 5, 241, 6]}, ["video tokens (<video>, id 241) but no video"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"speech": img}},
         ["['speech']: LLaVA-OneVision (LlavaOnevisionForConditionalGeneration) takes \"image\" and \"video\""]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"audio": img}},
         ["(LlavaOnevisionForConditionalGeneration) takes no audio input"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 16, 16)}},
         ["uint8 pixels [3, H, W]", "[3, 16, 16] float32"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": "cat.png"}}, ["image 0 is a str"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}}, ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids}, ["no image was given"]),
        ({"prompt_token_ids": ids + [5] * 30, "multi_modal_data": {"image": big}}, ["max_model_len is 120"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": tile}},
         ["an image of 20 x 33 has float tiles [7, 3, 16, 16]", "got [1, 3, 16, 16]"]),
        ({"prompt_token_ids": good[0], "multi_modal_data": {"image": [anyres_pixels(img, vc), img]}},
         ["image 0: an image among several of a prompt is one float tile [1, 3, 16, 16]"]),
    ]
    batch = [{"prompt_token_ids": good[0], "multi_modal_data": {"image": good[1]}}, *(b for b, _ in bad)]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1]) == [_want(hf, tok, good[0], good[1], llm)]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_pixels_preprocessed_and_expanded_ids_are_kept(ov_ckpt):
    """uint8 pixels [3, H, W] (the server's admit_image), AnyResImage's given and ids
    already expanded give the PIL images' tokens, for an image alone and for two."""
    path, hf, tok = ov_ckpt
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    for ids, imgs in (_case(tok, 8, 1, first=4), _case(tok, 9, 2)):
        items = _items(imgs, enc.config)
        raw = [enc.admit_image(im, i) for i, im in enumerate(imgs)]
        assert all(r.dtype == torch.uint8 and r.shape[0] == 3 for r in raw)
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}},
                             {"prompt_token_ids": ids, "multi_modal_data": {"image": raw}},
                             {"prompt_token_ids": ids, "multi_modal_data": {"image": items}},
                             {"prompt_token_ids": _expanded(ids, tok, items), "multi_modal_data": {"image": imgs}}],
                            GREEDY, use_tqdm=False)
        assert _tokens(outs) == [_want(hf, tok, ids, imgs, llm)] * 4


def _video(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """n frames uint8 (T, H, W, 3) drifting smoothly."""
    return np.stack([np.asarray(smooth_image(h, w, seed=seed + k)) for k in range(n)])


def test_videos_equal_transformers(ov_ckpt):
    """A video alone (frames of another size than the tower's), a video after an image in
    one prompt (the image tiled: the prompt's only one), in one batch and in steps of 16
    tokens: transformers' tokens with pixel_values_videos; a repeated video hits the prefix
    cache."""
    path, hf, tok = ov_ckpt
    vtok = hf.config.video_token_index
    vid, vid2 = _video(3, 30, 40, 1), _video(2, 16, 16, 5)
    img = smooth_image(45, 40, seed=3)
    ids_v = [1, 14, 15, vtok, 16, 17, 18]
    ids_iv = [1, 20, tok, 21, vtok, 22, 23]
    llm = _llm(path)
    vc = llm.engine.mm_encoder.config
    v, v2 = video_frames(vid, vc), video_frames(vid2, vc)
    assert (v.rows, v2.rows) == (3 * 4 + 1, 2 * 4 + 1)  # 4 x 4 patches pooled to 2 x 2 a frame
    item = anyres_pixels(img, vc)

    want = [_want_video(hf, ids_v, [], v, vc), _want_video(hf, ids_iv, [item], v2, vc)]
    prompts = [{"prompt_token_ids": ids_v, "multi_modal_data": {"video": vid}},
               {"prompt_token_ids": ids_iv,  # this video as a list of PIL frames
                "multi_modal_data": {"image": img, "video": [Image.fromarray(f) for f in vid2]}}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    assert len(outs[1].prompt_token_ids) == len(ids_iv) - 2 + item.rows + v2.rows
    chunked = _llm(path, max_num_batched_tokens=16)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == want
    kv = llm.engine.kv_manager
    hits = kv.prefix_hits
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == want[:1]
    assert kv.prefix_hits - hits == (len(ids_v) - 1 + v.rows - 1) // 8 * 8
    assert kv.stats().blocks_used == 0 and chunked.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llava_onevision_on_the_gpu_bf16(tmp_path, monkeypatch):
    """bf16 on CUDA (triton backend, graphs captured), images and videos: tokens equal an
    eager engine's;
    against transformers, teacher-forced on fp32 transformers' greedy continuations (greedy
    bf16 runs of a tiny random model part chaotically once one token differs), our bf16
    top tokens agree with the fp32 ones as often as transformers' bf16 do."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = build_tiny_llava_onevision(tmp_path / "ov64", text=dict(hidden_size=128, num_attention_heads=2,
                                                                   num_key_value_heads=1))  # head_dim 64
    hf32 = hf_llava_onevision(path, device="cuda")
    tok, vtok = hf32.config.image_token_index, hf32.config.video_token_index
    # images (none, one, two) and two prompts with a video (alone, after an image)
    cases = [(*_case(tok, 60 + i, i % 3), None) for i in range(6)]
    cases += [([1, 14, 15, vtok, 16, 17], [], _video(4, 30, 40, 1)),
              ([1, 20, tok, 21, vtok, 22], [smooth_image(45, 40, seed=3)], _video(2, 16, 24, 5))]

    def mm(ims, vid) -> dict:
        data = {**({"image": ims} if ims else {}), **({"video": vid} if vid is not None else {})}
        return {"multi_modal_data": data} if data else {}

    prompts = [{"prompt_token_ids": ids, **mm(ims, vid)} for ids, ims, vid in cases]

    def llm16(**kw) -> LLM:
        return LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                   max_num_batched_tokens=128, **kw)

    graphed_llm = llm16()
    graphed = _tokens(graphed_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert graphed == _tokens(llm16(enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    vc = graphed_llm.engine.mm_encoder.config
    videos = [video_frames(vid, vc) if vid is not None else None for _, _, vid in cases]
    truth = [_want(hf32, tok, ids, ims, graphed_llm) if v is None
             else _want_video(hf32, ids, _items(ims, vc) if ims else [], v, vc)
             for (ids, ims, _), v in zip(cases, videos, strict=True)]
    del hf32
    hf16 = hf_llava_onevision(path, dtype=torch.bfloat16, device="cuda")
    ours = theirs = total = 0
    for (ids, ims, vid), v, t in zip(cases, videos, truth, strict=True):
        # teacher-forced up to a generated <image> / <video> (the tiny vocabulary has them):
        # in a prompt it would be a placeholder without its item
        t = t[:min([t.index(x) for x in (tok, vtok) if x in t], default=len(t))]
        if not t:
            continue
        items = _items(ims, vc) if ims else []
        expanded = _expanded(ids, tok, items) if v is None else _video_expanded(ids, tok, vtok, items, v)
        kw = hf_inputs(hf16, items) if v is None else _video_kw(hf16, vc, items, v)
        seq = expanded + t
        with torch.no_grad():
            logits = hf16(input_ids=torch.tensor([seq], device="cuda"), **kw).logits[0]
        theirs += sum(a == b for a, b in zip(logits[len(expanded) - 1:-1].argmax(-1).tolist(), t, strict=True))
        out = graphed_llm.generate({"prompt_token_ids": ids + t, **mm(ims, vid)},
                                   SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                                   use_tqdm=False)[0]
        assert out.error is None, out.error
        ours += sum(out.prompt_logprobs[i].rank == 1 for i in range(len(expanded), len(seq)))
        total += len(t)
    assert ours >= theirs - 0.03 * total and ours >= 0.85 * total, (ours, theirs, total)
    assert graphed_llm.engine.kv_manager.stats().blocks_used == 0
