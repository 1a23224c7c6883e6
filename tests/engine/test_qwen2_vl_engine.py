"""Qwen2-VL / Qwen2.5-VL image input through the engine (models/qwen2_vl.py, engine/mrope.py):
greedy tokens equal transformers' generate with the same patches (one image, two of different
sizes, text-only prompts, a batch mixing them; chunked prefill cutting through images,
preemption recomputing them, a prefix-cache hit on a repeated image prompt; torch_native and
the triton backend's fused rotary in the interpreter), LLM.chat's image parts placed as Qwen's
template places them, and bad requests refused by name without a leaked block. fp32, CPU;
one CUDA test with graphs in bf16 (skipped without a GPU)."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import assert_top_one_agreement
from tests.conftest import count_encodes as _spy
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl, hf_qwen, hf_qwen_greedy

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SIZES = [(84, 112), (60, 90), (100, 40), (56, 56)]  # 12, 6, 4 and 4 rows


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    built = {}

    def get(variant: str):
        if variant not in built:
            path = build_tiny_qwen2_vl(tmp_path_factory.mktemp(variant), variant)
            built[variant] = (path, hf_qwen(path, variant))
        return built[variant]

    return get


def _case(enc, seed: int, n_images: int):
    """(prompt ids with a <|vision_start|><|image_pad|><|vision_end|> per image, the images)."""
    vs, pad, ve = enc.placeholder_ids
    g = torch.Generator().manual_seed(seed)
    text = (torch.randint(3, 200, (12,), generator=g)).tolist()
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


def test_images_and_text_equal_transformers(qwen):
    """One image, two of different sizes, a text-only prompt, in one batch (Qwen2-VL)."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 0, 1), _case(enc, 1, 2), _case(enc, 2, 0)]
    outs = llm.generate(_prompts(cases), GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims) for o, (_, ims) in zip(outs, cases, strict=True)]
    n_img = [sum(1 for t in o.prompt_token_ids if t == enc.config.image_token_id) for o in outs]
    assert n_img == [12, 6 + 4, 0]  # each <|image_pad|> made its image's rows
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption_through_images(qwen, monkeypatch, async_scheduling):
    """Qwen2.5-VL (windowed tower): prompts cut into chunks of 6 tokens (3-D positions
    split anywhere, text after an image taking its shifted 1-D positions in a later step),
    few blocks (preempted requests recompute images' rows without encoding them again)."""
    path, hf = qwen("qwen2_5_vl")
    llm = _llm(path, max_num_batched_tokens=6, block_size=4, num_gpu_blocks=16,
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


def test_text_before_an_image_is_shared_with_text_requests(qwen):
    """A text-only request's blocks serve an image request with the same text before its
    image (its positions are the text's: M-RoPE shifts only what follows an image), up to
    the block the image starts in; tokens are transformers' for both."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path)
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    vs, pad, ve = enc.placeholder_ids
    head = [1, *range(20, 39)]  # 20 text tokens: blocks 0-1 full, the image starts in block 2
    img = smooth_image(*SIZES[0], seed=77)
    text = llm.generate([{"prompt_token_ids": head + [50, 51, 52]}], GREEDY, use_tqdm=False)[0]
    assert _tokens([text])[0] == _want(hf, llm, text, [])
    hits = kv.prefix_hits
    out = llm.generate([{"prompt_token_ids": head + [vs, pad, ve, 60, 61], "multi_modal_data": {"image": img}}],
                       GREEDY, use_tqdm=False)[0]
    assert _tokens([out])[0] == _want(hf, llm, out, [img])
    assert kv.prefix_hits - hits == 16
    assert kv.stats().blocks_used == 0


def test_prefix_cache_hit_on_a_repeated_image_prompt(qwen, monkeypatch):
    """The same prompt and image again hits its blocks (the tower does not run: every row's
    block came from the cache; the text after it takes its shifted positions); a flat-color
    image of another shape but the same patches' bytes hits nothing (its grid differs)."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path)
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    encoded = _spy(monkeypatch, enc)
    ids, (img,) = _case(enc, 30, 1)
    ids = ids + list(range(40, 60))  # 1 + 3 + 3 + 2 + 7 + 20 (image: 12 rows) = 45: 5 full blocks

    def run(image):
        return llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}],
                            GREEDY, use_tqdm=False)[0]

    first = run(img)
    assert _tokens([first])[0] == _want(hf, llm, first, [img])
    hits = kv.prefix_hits
    again = run(img.copy())
    assert _tokens([again]) == _tokens([first])
    n = len(first.prompt_token_ids)
    assert n > 24 + 8 and kv.prefix_hits - hits == (n - 1) // 8 * 8 and encoded == [1]
    from PIL import Image

    wide, tall = Image.new("RGB", (112, 56), (90, 20, 200)), Image.new("RGB", (56, 112), (90, 20, 200))
    a, b = enc.pixel_values(wide), enc.pixel_values(tall)
    assert torch.equal(a.patches, b.patches) and a.grid != b.grid
    hits = kv.prefix_hits
    outs = [run(wide), run(tall)]
    assert kv.prefix_hits == hits
    assert _tokens(outs) == [_want(hf, llm, o, [im]) for o, im in zip(outs, (wide, tall), strict=True)]
    assert kv.stats().blocks_used == 0


def test_kv_offloading_brings_an_image_prompts_blocks_back(qwen):
    """An image prompt's blocks evicted to the host tier by other prompts come back for the
    same prompt and image (host hits; 3-D positions' K/V as computed), the same tokens."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path, num_gpu_blocks=12, kv_offloading_size=0.001)
    enc = llm.engine.mm_encoder
    vs, pad, ve = enc.placeholder_ids
    img = smooth_image(84, 112, seed=3)
    req = {"prompt_token_ids": [1, 5, 6, vs, pad, ve, *range(10, 40)], "multi_modal_data": {"image": img}}
    first = llm.generate([req], GREEDY, use_tqdm=False)[0]
    llm.generate([[1, *range(50 + i, 90 + i)] for i in range(6)], GREEDY, use_tqdm=False)
    again = llm.generate([req], GREEDY, use_tqdm=False)[0]
    stats = llm.engine.kv_manager.stats()
    assert stats.host_hits >= 40 and stats.blocks_used == 0
    assert _tokens([again]) == _tokens([first]) == [_want(hf, llm, first, [img])]


def test_triton_backend_fused_rotary_in_the_interpreter(tmp_path, monkeypatch):
    """The triton backend (its rotary fused with the K/V write, 3-D positions as a per-token
    cos / sin table) on the CPU's interpreter: Qwen2.5-VL, head_dim 32, an image request
    cut into chunks beside a text-only one: transformers' tokens."""
    path = build_tiny_qwen2_vl(tmp_path / "q32", "qwen2_5_vl", text=dict(
        num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}))
    hf = hf_qwen(path, "qwen2_5_vl")
    llm = _llm(path, attention_backend="triton", max_num_batched_tokens=9)
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 41, 1), _case(enc, 42, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(_prompts(cases), params, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims, 4) for o, (_, ims) in zip(outs, cases, strict=True)]


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_llm_chat_places_images_as_qwens_template(qwen):
    """LLM.chat with image_url (a data URL) and image_pil parts: Qwen's template prints each
    as <|vision_start|><|image_pad|><|vision_end|> where the part is; the tokens equal
    generate's on the template's ids."""
    path, hf = qwen("qwen2_vl")
    llm = _llm(path)
    tok = llm.get_tokenizer()
    enc = llm.engine.mm_encoder
    a, b = smooth_image(60, 90, seed=5), smooth_image(100, 40, seed=6)
    conv = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": _data_url(a)}},
                                         {"type": "text", "text": "and"},
                                         {"type": "image_pil", "image_pil": b}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    assert out.error is None
    vs, pad, ve = enc.placeholder_ids
    got = out.prompt_token_ids
    first, second = got.index(vs), len(got) - 1 - got[::-1].index(vs)
    assert got[first:first + 8] == [vs, *[pad] * 6, ve] and got[second:second + 6] == [vs, *[pad] * 4, ve]
    assert tok.decode(got[first + 8:second]).strip() == "and"
    assert tok.decode(got[:first]).endswith("look")
    parts = [{"type": "text", "text": "look"}, {"type": "image"}, {"type": "text", "text": "and"},
             {"type": "image"}]
    ids = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    want = llm.generate([{"prompt_token_ids": list(ids), "multi_modal_data": {"image": [a, b]}}], GREEDY,
                        use_tqdm=False)[0]
    assert want.prompt_token_ids == out.prompt_token_ids
    assert out.outputs[0].token_ids == want.outputs[0].token_ids == _want(hf, llm, out, [a, b])


def test_bad_requests_are_refused_by_name_and_leak_nothing(qwen):
    path, hf = qwen("qwen2_vl")
    llm = _llm(path, max_model_len=64)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    enc = llm.engine.mm_encoder
    ids, (img,) = _case(enc, 50, 1)
    pad, video = enc.config.image_token_id, enc.config.video_token_id
    plain = [t for t in ids if t != pad]
    bad = [
        ({"prompt_token_ids": plain, "multi_modal_data": {"image": img}}, ["0 image token(s)", "1 image(s)"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}}, ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids}, ["<|image_pad|>", "no image was given"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": [img]}}, ["1 image token(s)", "0 image(s)"]),
        ({"prompt_token_ids": [*ids, video], "multi_modal_data": {"image": img}},
         ["1 video token(s)", "0 video(s)"]),
        ({"prompt_token_ids": [1, video, 5]}, ["video tokens", "no video was given"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": smooth_image(10, 2500)}}, ["aspect ratio"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 28, 28)}}, ["uint8", "float32"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": "cat.png"}}, ["image 0 is a str"]),
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
    u8 = torch.zeros(3, 56, 56, dtype=torch.uint8)  # a uint8 tensor image is preprocessed
    assert llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": u8}}], GREEDY,
                        use_tqdm=False)[0].error is None
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen2_vl_on_the_gpu_with_graphs_bf16(tmp_path):
    """bf16 on CUDA (triton backend, CUDA graphs captured): image prefill steps run eagerly
    with 3-D positions, decodes replay graphs with shifted positions (index + delta < index);
    tokens equal an eager engine's. Against transformers on the GPU, teacher-forced on our
    tokens: our token is fp32's top one about as often as transformers' own bf16 top token is
    (within 3 points, and at least 85%, as the LLaVA-NeXT test asks): a tiny random model's near ties flip under bf16
    rounding either way (run 229 saw a first token flip against transformers' bf16), while a
    wrong position, rotary or image row would cost far more agreement."""
    for variant in ("qwen2_vl", "qwen2_5_vl"):
        path = build_tiny_qwen2_vl(tmp_path / variant, variant, text=dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}))
        hf = hf_qwen(path, variant).to("cuda")
        hf16 = hf_qwen(path, variant).to("cuda", torch.bfloat16)

        def run(path=path, **kw):
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

        def mm_inputs(i, x, cases=cases, enc=enc):
            px = [enc.pixel_values(im) for im in cases[i][1]]
            if not px:
                return {}
            return dict(pixel_values=torch.cat([p.patches for p in px]),
                        image_grid_thw=torch.tensor([list(p.grid) for p in px]),
                        mm_token_type_ids=(x == enc.config.image_token_id).int())

        assert_top_one_agreement(variant, hf, hf16, outs, mm_inputs)
        assert llm.engine.kv_manager.stats().blocks_used == 0


def test_mm_processor_kwargs_set_the_pixel_bounds(qwen):
    """vLLM's mm_processor_kwargs: max_pixels lowered, an image takes fewer rows (its
    resize the processor's with that bound) and the tokens are transformers' on those
    patches; keys the processor does not read, or bad bounds, are ConfigErrors."""
    from flashpage.cli import _json_object
    from flashpage.config import ConfigError

    path, hf = qwen("qwen2_vl")
    small = _llm(path, mm_processor_kwargs={"max_pixels": 56 * 56})
    enc = small.engine.mm_encoder
    ids, (img,) = _case(enc, 0, 1)  # 84 x 112: 12 rows at the tiny processor's own bounds
    out = small.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY,
                         use_tqdm=False)[0]
    assert sum(t == enc.config.image_token_id for t in out.prompt_token_ids) == 2  # 28 x 56 after resize
    assert _tokens([out])[0] == _want(hf, small, out, [img])
    for bad, needle in (({"do_resize": False}, "read min_pixels, max_pixels, size and fps"),
                        ({"max_pixels": 0}, "positive int"), ({"min_pixels": 10**7}, "above max_pixels")):
        with pytest.raises(ConfigError, match=needle):
            _llm(path, mm_processor_kwargs=bad)
    assert _json_object('{"max_pixels": 3136}') == {"max_pixels": 3136}
