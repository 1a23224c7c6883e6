"""Qwen3-VL image input through the engine (models/qwen3_vl.py, engine/multimodal.py's
deepstack features, interleaved M-RoPE): greedy tokens equal transformers' generate with the
same patches (one image, two of different sizes, a text-only prompt, in one batch; chunked
prefill cutting through images, each chunk adding its part of an image's deepstack features;
preemption; a prefix-cache hit on a repeated image prompt, and one ending inside an image),
and bad requests (a wrong count of image tokens, a one-frame video) refused by name without a
leaked block (videos: tests/engine/test_qwen3_vl_video.py). fp32, CPU; one CUDA test in bf16 (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import assert_top_one_agreement
from tests.conftest import count_encodes as _spy
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import hf_qwen_greedy
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl, hf_qwen3_vl

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SIZES = [(96, 128), (64, 96), (128, 40), (64, 64)]  # 12, 6, 4 and 4 rows


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))
    return path, hf_qwen3_vl(path)


def _case(enc, seed: int, n_images: int):
    """(prompt ids with a <|vision_start|><|image_pad|><|vision_end|> per image, the images)."""
    vs, pad, ve = enc.placeholder_ids
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 200, (12,), generator=g).tolist()
    ids = [1, *text[:3]]
    for i in range(n_images):
        ids += [vs, pad, ve, *text[3 + 2 * i: 5 + 2 * i]]
    ids += text[3 + 2 * n_images:]
    images = [smooth_image(*SIZES[(seed + i) % len(SIZES)], seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _want(hf, llm, out, images, max_new=MAX_NEW):
    enc = llm.engine.mm_encoder
    return hf_qwen_greedy(hf, out.prompt_token_ids, [enc.pixel_values(im) for im in images], max_new)


def _prompts(cases):
    return [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
            for ids, ims in cases]


def test_images_and_text_equal_transformers(qwen3, monkeypatch):
    """One image, two of different sizes, a text-only prompt, in one batch; without the
    deepstack features (zeroed) the image requests' tokens are no longer transformers'."""
    path, hf = qwen3
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 0, 1), _case(enc, 1, 2), _case(enc, 2, 0)]
    outs = llm.generate(_prompts(cases), GREEDY, use_tqdm=False)
    want = [_want(hf, llm, o, ims) for o, (_, ims) in zip(outs, cases, strict=True)]
    assert _tokens(outs) == want
    n_img = [sum(1 for t in o.prompt_token_ids if t == enc.config.image_token_id) for o in outs]
    assert n_img == [12, 6 + 4, 0]  # each <|image_pad|> made its image's rows
    assert llm.engine.kv_manager.stats().blocks_used == 0
    bare = _llm(path, enable_prefix_caching=False)
    encode = bare.engine.mm_encoder.encode
    monkeypatch.setattr(bare.engine.mm_encoder, "encode",
                        lambda data: [(r, torch.zeros_like(d)) for r, d in encode(data)])
    without = _tokens(bare.generate(_prompts(cases[:2]), GREEDY, use_tqdm=False))
    assert without != want[:2]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption_through_images(qwen3, monkeypatch, async_scheduling):
    """Prompts cut into chunks of 5 tokens (an image's rows and their deepstack features
    split across steps), few blocks (preempted requests recompute images' rows and features
    without encoding them again): transformers' tokens, each image encoded once."""
    path, hf = qwen3
    llm = _llm(path, max_num_batched_tokens=5, block_size=4, num_gpu_blocks=16,
               enable_prefix_caching=False, async_scheduling=async_scheduling)
    enc = llm.engine.mm_encoder
    encoded = _spy(monkeypatch, enc)
    cases = [_case(enc, 10 + i, i % 3) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = llm.engine.kv_manager.num_free_blocks
    outs = llm.generate(_prompts(cases), params, use_tqdm=False)
    if not async_scheduling:
        assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [_want(hf, llm, o, ims, 16) for o, (_, ims) in zip(outs, cases, strict=True)]
    assert sum(encoded) == sum(len(ims) for _, ims in cases)  # each image once
    assert llm.engine.kv_manager.num_free_blocks == free


def test_prefix_cache_hits_on_a_repeated_image(qwen3, monkeypatch):
    """The same prompt and image again: every block hit but the last, the tower not run.
    The same text and image before other text: the hit ends inside the image (blocks 0-1),
    the step computes the image's last rows with their part of the deepstack features."""
    path, hf = qwen3
    llm = _llm(path, mm_encoder_cache_tokens=0)  # the tower runs again wherever the prefix cache misses
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    encoded = _spy(monkeypatch, enc)
    vs, pad, ve = enc.placeholder_ids
    img = smooth_image(*SIZES[0], seed=5)  # 12 rows: positions 4 .. 15 of 4 + 12 + 1
    head = [1, 5, 6, vs, pad, ve]

    def run(tail):
        return llm.generate([{"prompt_token_ids": head + tail, "multi_modal_data": {"image": img}}],
                            GREEDY, use_tqdm=False)[0]

    first = run(list(range(40, 60)))
    assert _tokens([first])[0] == _want(hf, llm, first, [img])
    hits = kv.prefix_hits
    again = run(list(range(40, 60)))
    n = len(first.prompt_token_ids)
    assert _tokens([again]) == _tokens([first])
    assert kv.prefix_hits - hits == (n - 1) // 8 * 8 and encoded == [1]
    # the image one position on (rows at 5 .. 16): no block of the first prompt's
    other = llm.generate([{"prompt_token_ids": [1, 5, 6, 7, vs, pad, ve, 70, 71],
                           "multi_modal_data": {"image": img}}], GREEDY, use_tqdm=False)[0]
    assert _tokens([other])[0] == _want(hf, llm, other, [img])
    assert encoded == [1, 1]
    hits = kv.prefix_hits
    part = llm.generate([{"prompt_token_ids": [1, 5, 6, 7, vs, pad, ve, 80, 81, 82],
                          "multi_modal_data": {"image": img}}], GREEDY, use_tqdm=False)[0]
    # other's blocks 0-1 (positions 0 .. 15) hit; the step starts at 16, the image's last row
    assert kv.prefix_hits - hits == 16 and encoded == [1, 1, 1]
    assert _tokens([part])[0] == _want(hf, llm, part, [img])
    assert kv.stats().blocks_used == 0


def test_bad_requests_are_refused_by_name_and_leak_nothing(qwen3):
    path, hf = qwen3
    llm = _llm(path, max_model_len=64)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    enc = llm.engine.mm_encoder
    ids, (img,) = _case(enc, 50, 1)
    pad, video = enc.config.image_token_id, enc.config.video_token_id
    plain = [t for t in ids if t != pad]
    frames = torch.zeros(1, 64, 64, 3, dtype=torch.uint8).numpy()
    bad = [
        ({"prompt_token_ids": plain, "multi_modal_data": {"image": img}}, ["0 image token(s)", "1 image(s)"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}}, ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids}, ["<|image_pad|>", "no image was given"]),
        ({"prompt_token_ids": [*plain, video], "multi_modal_data": {"video": frames}},
         ["video 0 could not be read", "at least temporal_patch_size (2) frames"]),
        ({"prompt_token_ids": [*ids, video], "multi_modal_data": {"image": img}},
         ["1 video token(s)", "0 video(s)"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": smooth_image(10, 2500)}}, ["aspect ratio"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 32, 32)}}, ["uint8", "float32"]),
        ({"prompt_token_ids": ids + [5] * 60, "multi_modal_data": {"image": img}}, ["max_model_len is 64"]),
    ]
    good = _case(enc, 51, 1)
    batch = [_prompts([good])[0], *(b for b, _ in bad), plain]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens([outs[0], outs[-1]]) == [_want(hf, llm, outs[0], good[1]), _want(hf, llm, outs[-1], [])]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_no_images_allowed_serves_the_text_model_alone(qwen3):
    """limit_mm_per_prompt {"image": 0, "video": 0}: the tower is not loaded, a text prompt's
    tokens are transformers' (Qwen3 with 1-D positions), an image
    request is refused by name."""
    path, hf = qwen3
    llm = _llm(path, limit_mm_per_prompt={"image": 0, "video": 0})
    assert llm.engine.mm_encoder is None
    ids = [1, *range(20, 35)]
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert _tokens([out])[0] == hf_qwen_greedy(hf, ids, None, MAX_NEW)
    bad = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": smooth_image(64, 64)}}],
                       GREEDY, use_tqdm=False)[0]
    assert bad.error is not None and "image" in bad.error


def test_mm_processor_kwargs_size_bounds_the_pixels(qwen3):
    """vLLM's mm_processor_kwargs in transformers' form, {"size": {"shortest_edge",
    "longest_edge"}}: a 96 x 128 image (12 rows at the checkpoint's bounds) resized under
    64 x 64 pixels takes 2 rows (32 x 64), transformers' tokens on those patches; size beside
    min_pixels, or another key in it, is a ConfigError."""
    from flashpage.config import ConfigError

    path, hf = qwen3
    small = _llm(path, mm_processor_kwargs={"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}})
    enc = small.engine.mm_encoder
    assert (enc.config.processing.min_pixels, enc.config.processing.max_pixels) == (32 * 32, 64 * 64)
    ids, (img,) = _case(enc, 0, 1)
    out = small.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY,
                         use_tqdm=False)[0]
    assert sum(t == enc.config.image_token_id for t in out.prompt_token_ids) == 2
    assert _tokens([out])[0] == _want(hf, small, out, [img])
    for bad, needle in (({"size": {"height": 64}}, "size must be"),
                        ({"size": {"longest_edge": 4096}, "min_pixels": 1024}, "not both")):
        with pytest.raises(ConfigError, match=needle):
            _llm(path, mm_processor_kwargs=bad)


def test_llm_chat_places_images_as_qwens_template(qwen3):
    """LLM.chat with an image_pil part: <|vision_start|><|image_pad|>*rows<|vision_end|>
    where the part is, the tokens transformers'."""
    path, hf = qwen3
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    img = smooth_image(*SIZES[1], seed=9)
    conv = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_pil", "image_pil": img}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    vs, pad, ve = enc.placeholder_ids
    got = out.prompt_token_ids
    at = got.index(vs)
    assert got[at:at + 8] == [vs, *[pad] * 6, ve]
    assert _tokens([out])[0] == _want(hf, llm, out, [img])


def test_triton_backend_fused_rotary_in_the_interpreter(tmp_path):
    """The triton backend (its rotary fused with the K/V write, interleaved 3-D positions
    as a per-token cos / sin table) on the CPU's interpreter, head_dim 32: an image request
    cut into chunks beside a text-only one, transformers' tokens."""
    path = build_tiny_qwen3_vl(tmp_path / "q32", text=dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4],
                         "mrope_interleaved": True}))
    hf = hf_qwen3_vl(path)
    llm = _llm(path, attention_backend="triton", max_num_batched_tokens=9)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 41, 1), _case(enc, 42, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(_prompts(cases), params, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims, 4) for o, (_, ims) in zip(outs, cases, strict=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_vl_on_the_gpu_with_graphs_bf16(tmp_path):
    """bf16 on CUDA (triton backend, CUDA graphs captured; image prefill steps eager with
    3-D positions and deepstack adds, decodes replaying graphs): tokens equal an eager
    engine's; against transformers on the GPU, teacher-forced on our tokens, our token is
    fp32's top one about as often as transformers' own bf16 top token is (within 3 points,
    and at least 85%, as the Qwen2-VL test asks)."""
    path = build_tiny_qwen3_vl(tmp_path / "q3", text=dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                         "mrope_interleaved": True}))
    hf = hf_qwen3_vl(path).to("cuda")
    hf16 = hf_qwen3_vl(path).to("cuda", torch.bfloat16)

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                  block_size=16, max_num_batched_tokens=64, **kw)
        enc = llm.engine.mm_encoder
        cases = [_case(enc, 60 + i, i % 3) for i in range(6)]
        return llm, cases, llm.generate(_prompts(cases), GREEDY, use_tqdm=False)

    llm, cases, outs = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
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

    assert_top_one_agreement("qwen3_vl", hf, hf16, outs, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
