"""Idefics3 and SmolVLM image input through the engine (models/idefics3.py on
engine/multimodal.py): greedy tokens equal transformers' Idefics3ForConditionalGeneration /
SmolVLMForConditionalGeneration.generate on its own processor's input_ids and pixel_values
(Idefics3Processor, Idefics3ImageProcessorPil / SmolVLMImageProcessorPil) for an image
alone and two of different sizes in one prompt, with image splitting (grids of tiles and the
global image) and without (one tile), a text-only prompt beside them, chunked prefill
cutting a tile's rows, preemption; LLM.chat with image parts; a repeated image hits the
prefix cache; bad requests are refused by name and leak nothing. fp32, CPU; one bf16 CUDA
test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.models.idefics3 import Idefics3Image, image_grid, num_tiles, tile_image
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.idefics3_checkpoint import (
    ROWS,
    build_tiny_idefics3,
    hf_greedy,
    hf_idefics3,
    hf_processor,
)
from tests.llava_checkpoint import smooth_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# (height, width): with splitting 2 x 3, 3 x 3, 3 x 1, 3 x 2 tiles (and the global one)
SIZES = [(20, 40), (16, 16), (45, 12), (33, 30)]
WORDS = ["the cat", "sat on", "the mat", "yes no", "maybe", "quick brown", "fox"]


@pytest.fixture(scope="module", params=["idefics3", "smolvlm_nosplit"])
def ckpt(request, tmp_path_factory):
    smolvlm = request.param.startswith("smolvlm")
    split = not request.param.endswith("nosplit")
    path = build_tiny_idefics3(tmp_path_factory.mktemp(request.param), smolvlm=smolvlm, splitting=split)
    return path, hf_idefics3(path), hf_processor(path, smolvlm, do_image_splitting=split), _llm(path)


def _case(seed: int, n_images: int, first: int = 0) -> tuple[str, list]:
    """(a text prompt with n <image> placeholders between words, its images: SIZES)."""
    words = [WORDS[(seed + i) % len(WORDS)] for i in range(n_images + 2)]
    text = words[0] + "".join(f" <image> {w}" for w in words[1:n_images + 1]) + " " + words[-1]
    return text, [smooth_image(*SIZES[(first + i) % len(SIZES)], seed=seed * 10 + i) for i in range(n_images)]


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, **({"multi_modal_data": {"image": images}} if images else {})}


def _want(hf, proc, text: str, images: list, max_new: int = MAX_NEW, **kw) -> tuple[list[int], list[int]]:
    """(transformers' prompt ids, its greedy tokens): the processor's text expansion and
    pixels."""
    inputs = proc(text=[text], images=[images], return_tensors="pt", **kw) if images else \
        proc.tokenizer([text], return_tensors="pt", **kw)
    return inputs["input_ids"][0].tolist(), hf_greedy(hf, inputs, max_new)


def test_images_equal_transformers_whole_and_chunked(ckpt):
    """An image alone, two of different sizes in one prompt, a text-only prompt, in one
    batch: the prompt ids the processor's, the tokens transformers'; then the same batch in
    steps of 16 tokens (a tile's rows cut across steps), each distinct tile through the tower
    once."""
    path, hf, proc, llm = ckpt
    cases = [_case(1, 1, first=0), _case(2, 2, first=1), _case(3, 0)]
    want = [_want(hf, proc, *c) for c in cases]
    outs = llm.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [w[1] for w in want]
    assert [o.prompt_token_ids for o in outs] == [w[0] for w in want]
    vc = llm.engine.mm_encoder.config
    tiles = [[len(tile_image(im, vc).pixels) for im in ims] for _, ims in cases]
    assert tiles == ([[7], [10, 4], []] if vc.splitting else [[1], [1, 1], []])
    assert [o.prompt_token_ids.count(vc.image_token_id) for o in outs] == [sum(t) * ROWS for t in tiles]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    chunked = _llm(path, max_num_batched_tokens=16)
    enc = chunked.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    assert _tokens(chunked.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False)) == [w[1] for w in want]
    assert sum(encoded) <= sum(map(sum, tiles)) and encoded
    assert chunked.engine.kv_manager.stats().blocks_used == 0


def test_smolvlm_splitting_and_preemption(tmp_path):
    """SmolVLM with image splitting, few blocks and steps of 32 tokens: preempted requests
    recompute their tiles' rows from the kept rows (no tile through the tower twice), tokens
    transformers', no block left behind."""
    path = build_tiny_idefics3(tmp_path / "smolvlm", smolvlm=True)
    hf, proc = hf_idefics3(path), hf_processor(path, True)
    llm = _llm(path, max_num_batched_tokens=32, block_size=4, num_gpu_blocks=48, enable_prefix_caching=False)
    assert llm.engine.model_config.multimodal_architecture == "SmolVLMForConditionalGeneration"
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    cases = [_case(20, 1, first=0), _case(21, 1, first=2), _case(24, 0)]  # 7 and 4 tiles: ~140 and ~80 tokens
    free = llm.engine.kv_manager.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([_prompt(*c) for c in cases], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [_want(hf, proc, *c, 12)[1] for c in cases]
    assert sum(encoded) <= sum(len(tile_image(c[1][0], enc.config).pixels) for c in cases[:2])
    assert llm.engine.kv_manager.num_free_blocks == free


def test_chat_with_image_parts(ckpt):
    """LLM.chat with two image_pil parts side by side: SmolVLM's template writes <image><image>,
    our prompt and tokens those of the processor's for that text."""
    path, hf, proc, llm = ckpt
    a, b = smooth_image(20, 40, seed=5), smooth_image(45, 12, seed=6)
    conv = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "image_pil", "image_pil": b},
                                         {"type": "text", "text": "the cat sat"}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "the cat sat"}]}],
        add_generation_prompt=True, tokenize=False)
    assert text.count("<image><image>") == 1  # side by side
    ids, want = _want(hf, proc, text, [a, b], add_special_tokens=False)  # the template's tokens alone
    assert out.prompt_token_ids == ids and _tokens([out]) == [want]


def test_prefix_cache_hit_on_a_repeated_image(ckpt):
    """The same image again (another PIL object of the same pixels) hits the first's blocks
    and its tower does not run; another image of the same size shares the text before it
    alone."""
    path, hf, proc, llm = ckpt
    kv = llm.engine.kv_manager
    text = "the quick brown fox sat on the mat <image> the cat"
    img = smooth_image(20, 40, seed=7)
    other = smooth_image(20, 40, seed=8)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)

    def run(image):
        return llm.generate([_prompt(text, [image])], GREEDY, use_tqdm=False)[0]

    first = run(img)
    assert _tokens([first]) == [_want(hf, proc, text, [img])[1]]
    n_prompt = len(first.prompt_token_ids)
    hits = kv.prefix_hits
    assert _tokens([run(img.copy())]) == _tokens([first])
    assert kv.prefix_hits - hits == (n_prompt - 1) // 8 * 8  # every full block but a last token's
    assert len(encoded) == 1
    hits = kv.prefix_hits
    assert _tokens([run(other)]) == [_want(hf, proc, text, [other])[1]]
    # the full blocks before the first tile's rows are shared, none after
    start = first.prompt_token_ids.index(enc.config.image_token_id)
    assert kv.prefix_hits - hits == start // 8 * 8
    assert kv.stats().blocks_used == 0
    del enc.encode


def test_bad_requests_are_refused_by_name_and_leak_nothing(ckpt):
    path, hf, proc, _ = ckpt
    llm = _llm(path, max_model_len=200)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    tok = llm.engine.mm_encoder.config.image_token_id
    vc = llm.engine.mm_encoder.config
    text, (img,) = _case(6, 1, first=3)
    good = _case(7, 1, first=2)
    ids = llm.get_tokenizer().encode(text)
    one = tile_image(img, vc)
    big = _case(8, 2, first=1)  # 14 tiles with splitting: past max_model_len
    bad = [
        ({"prompt": text, "multi_modal_data": {"video": [img]}}, ["multi_modal_data ['video']: this model takes"]),
        ({"prompt": text, "multi_modal_data": {"image": torch.zeros(3, 16, 16)}},
         ["uint8 pixels [3, H, W]", "[3, 16, 16] float32"]),
        ({"prompt": text, "multi_modal_data": {"image": "cat.png"}}, ["image 0 is a str"]),
        ({"prompt": text, "multi_modal_data": {"image": [img, img]}},
         [f"1 image token(s) (<image>, id {tok}) but 2 image(s)"]),
        ({"prompt": text}, [f"image tokens (<image>, id {tok}) but no image was given"]),
        ({"prompt_token_ids": [t for t in ids if t != tok] + [tok, tok], "multi_modal_data": {"image": img}},
         [f"2 image token(s) (<image>, id {tok}) but 1 image(s)"]),
        ({"prompt_token_ids": ids[:2] + [vc.fake_token_id] + ids[2:], "multi_modal_data": {"image": img}},
         ["<fake_token_around_image>", "ids the processor expanded are not read"]),
        ({"prompt": text, "multi_modal_data": {"image": Idefics3Image(torch.cat([one.pixels, one.pixels[:1]]),
                                                                      one.size, one.grid)}},
         [f"image 0: an image of {one.size[0]} x {one.size[1]} has tiles [{len(one.pixels)}, 3, 16, 16]",
          f"got [{len(one.pixels) + 1}, 3, 16, 16]"]),
        ({"prompt": text, "multi_modal_data": {
            "image": Idefics3Image(torch.full(tuple(one.pixels.shape), float("nan")), (33, 30), (0, 0))}},
         ["image 0: pixel values hold inf or NaN"]),
    ]
    if vc.splitting:
        bad.append((_prompt(*big), ["max_model_len is 200"]))
    outs = llm.generate([_prompt(*good), *(b for b, _ in bad)], GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1]) == [_want(hf, proc, *good)[1]]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_pixels_and_tiles_given_are_kept(ckpt):
    """uint8 pixels [3, H, W] and Idefics3Image's given (uint8 tiles, and float pixel
    values, the processor's) give the PIL images' tokens; the grid is the processor's."""
    path, hf, proc, llm = ckpt
    vc = llm.engine.mm_encoder.config
    text, imgs = _case(9, 2, first=2)
    items = [tile_image(im, vc) for im in imgs]
    px = proc.image_processor(images=[imgs], return_tensors="pt", return_row_col_info=True)
    assert [(r, c) for r, c in zip(px["rows"][0], px["cols"][0], strict=True)] == [it.grid for it in items]
    assert [it.grid for it in items] == [image_grid(vc, (im.size[1], im.size[0])) for im in imgs]
    pixels = [torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous() for im in imgs]
    k, floats = 0, []
    for it in items:
        n = it.pixels.shape[0]
        floats.append(Idefics3Image(px["pixel_values"][0, k:k + n], it.size, it.grid))
        k += n
    outs = llm.generate([_prompt(text, imgs), _prompt(text, pixels), _prompt(text, items), _prompt(text, floats)],
                        GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, proc, text, imgs)[1]] * 4


def test_config_errors_name_the_field(ckpt, tmp_path):
    """A processor whose tiles are not the tower's square, or whose image_seq_len is not a
    tile's rows, and a vision_config of another tower are refused by name; transformers
    4.4x's tower model_type ("idefics3") is read."""
    import json
    import shutil

    path = ckpt[0]
    for name, edit, needle in (("preprocessor_config.json", {"max_image_size": {"longest_edge": 32}},
                                "max_image_size 32"),
                               ("processor_config.json", {"image_seq_len": 64}, "image_seq_len 64")):
        dst = tmp_path / name
        shutil.copytree(path, dst)
        d = json.loads((dst / name).read_text())
        (dst / name).write_text(json.dumps({**d, **edit}))
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_hf(str(dst))
    d = json.loads((path / "config.json").read_text())
    old = {**d, "vision_config": {**d["vision_config"], "model_type": "idefics3"}}
    vc = ModelConfig.from_hf(old).vision
    assert (vc.hidden_size, vc.num_hidden_layers, vc.tokens_per_image) == (32, 2, ROWS)
    with pytest.raises(ConfigError, match="vision_config.model_type 'siglip_vision_model'"):
        ModelConfig.from_hf({**d, "vision_config": {**d["vision_config"], "model_type": "siglip_vision_model"}})


def test_mm_processor_kwargs_size_and_splitting(ckpt):
    """vLLM's mm_processor_kwargs as Idefics3Processor's call reads them, engine-wide:
    do_image_splitting true over the file's false with size {"longest_edge": 32} (grids of at
    most 2 x 2), false over its true (one tile); prompt ids and tokens transformers' with the same kwargs; a key
    it does not read, a bad size, a grid past the tokenizer's <row_r_col_c> and tiles not the
    tower's are ConfigErrors; per request they are refused by name."""
    path, hf, proc, base = ckpt
    text, imgs = _case(13, 2, first=0)
    # the file's splitting turned the other way (and a smaller longest edge with it on)
    on = base.engine.mm_encoder.config.splitting
    for kw in ({"do_image_splitting": False},) if on else ({"do_image_splitting": True, "size": {"longest_edge": 32}},):
        llm = _llm(path, mm_processor_kwargs=kw)
        out = llm.generate([_prompt(text, imgs)], GREEDY, use_tqdm=False)[0]
        ids, want = _want(hf, proc, text, imgs, images_kwargs=kw)
        assert out.prompt_token_ids == ids and _tokens([out]) == [want], kw
        split = kw.get("do_image_splitting", llm.engine.mm_encoder.config.splitting)
        assert out.prompt_token_ids.count(llm.engine.mm_encoder.config.image_token_id) == \
            (sum(num_tiles(llm.engine.mm_encoder.config, (im.size[1], im.size[0])) for im in imgs) if split else 2) * ROWS
    for bad, needle in (({"max_patches": 4}, r"\['max_patches'\].*reads size, do_image_splitting"),
                        ({"size": {"shortest_edge": 32}}, "size must be"),
                        ({"size": {"longest_edge": 112}, "do_image_splitting": True}, "grids of up to 7 x 7 tiles"),
                        ({"max_image_size": {"longest_edge": 32}}, "tiles other than"),
                        ({"do_image_splitting": 1}, "do_image_splitting must be true or false")):
        with pytest.raises(ConfigError, match=needle):
            _llm(path, mm_processor_kwargs=bad)
    llm = ckpt[3]
    outs = llm.generate([{**_prompt(text, imgs), "mm_processor_kwargs": {"size": {"longest_edge": 32}}},
                         _prompt(text, imgs)], GREEDY, use_tqdm=False)
    assert outs[0].error is not None and "engine-wide only" in outs[0].error
    assert outs[1].error is None and llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_idefics3_on_the_gpu_bf16(tmp_path, monkeypatch):
    """bf16 on CUDA (triton backend, graphs captured): tokens equal an eager engine's;
    against transformers, teacher-forced on fp32 transformers' greedy continuations (greedy
    bf16 runs of a tiny random model part chaotically once one token differs), our bf16
    top tokens agree with the fp32 ones as often as transformers' bf16 do."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = build_tiny_idefics3(tmp_path / "i3_64", smolvlm=True,
                               text=dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1))  # head_dim 64
    hf32 = hf_idefics3(path, device="cuda")
    proc = hf_processor(path, True)
    cases = [_case(60 + i, i % 3, first=i) for i in range(8)]  # none, one and two images

    def llm16(**kw) -> LLM:
        return LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                   max_num_batched_tokens=128, **kw)

    graphed_llm = llm16()
    graphed = _tokens(graphed_llm.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False))
    assert graphed == _tokens(llm16(enforce_eager=True).generate([_prompt(*c) for c in cases], GREEDY,
                                                                 use_tqdm=False))
    vc = graphed_llm.engine.mm_encoder.config
    truth = [_want(hf32, proc, *c) for c in cases]
    del hf32
    hf16 = hf_idefics3(path, dtype=torch.bfloat16, device="cuda")
    ours = theirs = total = 0
    for (text, ims), (ids, t) in zip(cases, truth, strict=True):
        # teacher-forced up to a generated <image> or <fake_token_around_image> (the tiny
        # vocabulary has them): in a prompt one is a placeholder without its image, the other
        # refused as ids expanded already
        stop = [i for i, x in enumerate(t) if x in (vc.image_token_id, vc.fake_token_id)]
        t = t[:stop[0]] if stop else t
        if not t:
            continue
        inputs = proc(text=[text], images=[ims], return_tensors="pt") if ims else proc.tokenizer([text],
                                                                                               return_tensors="pt")
        kw = {"input_ids": torch.tensor([ids + t], device="cuda")}
        if ims:
            kw["pixel_values"] = inputs["pixel_values"].to("cuda", torch.bfloat16)
            kw["pixel_attention_mask"] = inputs["pixel_attention_mask"].to("cuda")
        with torch.no_grad():
            logits = hf16(**kw).logits[0]
        theirs += sum(a == b for a, b in zip(logits[len(ids) - 1:-1].argmax(-1).tolist(), t, strict=True))
        prompt = graphed_llm.get_tokenizer().encode(text) + t
        out = graphed_llm.generate({"prompt_token_ids": prompt, **({"multi_modal_data": {"image": ims}} if ims else {})},
                                   SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                                   use_tqdm=False)[0]
        assert out.error is None, out.error
        assert out.prompt_token_ids == ids + t
        ours += sum(out.prompt_logprobs[i].rank == 1 for i in range(len(ids), len(ids) + len(t)))
        total += len(t)
    assert ours >= theirs - 0.03 * total and ours >= 0.85 * total, (ours, theirs, total)
    assert graphed_llm.engine.kv_manager.stats().blocks_used == 0
