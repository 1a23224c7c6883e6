"""Gemma 3's pan-and-scan (models/gemma3_pan_and_scan.py): the crops' boxes equal
Gemma3ImageProcessor's, and through the engine the prompt's ids equal Gemma3Processor's
(its text around the crops), the pixels its image processor's (within one uint8 level) and
the greedy tokens transformers' generate on them, for a wide image that gets crops, a tall
one and a square one that gets none; per request (mm_processor_kwargs) and engine-wide
(preprocessor_config.json, LLM(mm_processor_kwargs=...)); crops never cut by a chunk; the
prefix cache and encoder cache keep a pan-and-scan'd image apart from the plain one; bad
values refused by name, leaking nothing. fp32, CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from flashpage import SamplingParams
from flashpage.engine.multimodal import chain_digest
from flashpage.models.clip_image import normalize
from flashpage.models.gemma3_config import PanAndScan
from flashpage.models.gemma3_pan_and_scan import PanScanImage, crop_boxes
from tests.conftest import assert_top_one_agreement, cpu_llm, edited_copy
from tests.conftest import ok_tokens as _tokens
from tests.gemma3_checkpoint import TOKENS, build_tiny_gemma3, hf_gemma3, hf_gemma3_greedy
from tests.llava_checkpoint import smooth_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LEVEL = 1 / 255 / 0.5 + 1e-6  # one uint8 level after Gemma 3's normalization
TEXT = "<start_of_turn>user\n<start_of_image>what is it?<end_of_turn>\n<start_of_turn>model\n"
TWO = "<start_of_turn>user\n<start_of_image>\nand\n<start_of_image> what?<end_of_turn>\n"
ON = {"do_pan_and_scan": True}
# engine-wide settings small enough for small images
SMALL = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 3,
         "pan_and_scan_min_ratio_to_activate": 1.5}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3_pas"))
    tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    proc = transformers.Gemma3Processor(transformers.Gemma3ImageProcessorPil.from_pretrained(path), tok,
                                        image_seq_length=TOKENS)
    return path, hf_gemma3(path), proc, cpu_llm(path, max_model_len=256)


def _hf_inputs(proc, text: str, images, kwargs: dict | None) -> tuple[list[int], torch.Tensor]:
    """Gemma3Processor's ids and pixel values [n, 3, S, S] (kwargs given at the call, as
    its own defaults win over the image processor's file)."""
    out = proc(images=images, text=text, return_tensors="pt", **(kwargs or {}))
    return out["input_ids"][0].tolist(), out["pixel_values"]


def _check(llm, hf, proc, text: str, images, kwargs: dict | None, out, crops: list[int]) -> None:
    """``out`` (our request of ``text`` and ``images``) against transformers: its ids,
    its images' crops and pixels, its tokens (transformers' generate on our pixels: the
    resize differs by at most one uint8 level)."""
    ids, pixels = _hf_inputs(proc, text, images, kwargs)
    assert out.prompt_token_ids == ids
    enc = llm.engine.mm_encoder
    vc = enc.config if not kwargs else replace(enc.config, pan_and_scan=replace(
        enc.config.pan_and_scan, enabled=kwargs.get("do_pan_and_scan", enc.config.pan_and_scan.enabled),
        **{k: kwargs[f"pan_and_scan_{k}"] for k in ("min_crop_size", "max_num_crops", "min_ratio_to_activate")
           if f"pan_and_scan_{k}" in kwargs}))
    admitted = [enc.admit_image(im, i, vc) for i, im in enumerate(images)]
    assert [a.num_crops if isinstance(a, PanScanImage) else 0 for a in admitted] == crops
    ours = torch.stack([normalize(x, vc.processing) for a in admitted
                        for x in (a.images if isinstance(a, PanScanImage) else [a])])
    assert ours.shape == pixels.shape == (sum(crops) + len(images), 3, vc.image_size, vc.image_size)
    assert (ours - pixels).abs().max() <= LEVEL
    assert out.prompt_token_ids.count(vc.image_token_id) == TOKENS * ours.shape[0]
    assert _tokens([out]) == [hf_gemma3_greedy(hf, ids, ours, MAX_NEW)]


def _prompt(proc, text: str, images, kwargs: dict | None = None) -> dict:
    p = {"prompt_token_ids": proc.tokenizer.encode(text), "multi_modal_data": {"image": images}}
    return {**p, "mm_processor_kwargs": kwargs} if kwargs is not None else p


@pytest.mark.parametrize("pas", [PanAndScan(True, 256, 4, 1.2), PanAndScan(True, 32, 3, 1.5),
                                 PanAndScan(True, 10, 8, 1.0), PanAndScan(True, 50, 2, 2.5)])
def test_crop_boxes_equal_the_image_processors(pas):
    """Every box over a range of sizes (landscape, portrait, square; crops whose count does
    not divide the side) cuts what Gemma3ImageProcessor.pan_and_scan cuts."""
    ip = transformers.Gemma3ImageProcessorPil()
    kw = dict(pan_and_scan_min_crop_size=pas.min_crop_size, pan_and_scan_max_num_crops=pas.max_num_crops,
              pan_and_scan_min_ratio_to_activate=pas.min_ratio_to_activate)
    seen = 0
    for h in (30, 61, 97, 260, 301):
        for w in (30, 59, 100, 299, 700, 1031):
            img = np.arange(h * w, dtype=np.int64).reshape(1, h, w)
            want = ip.pan_and_scan(image=img, **kw)
            got = [img[:, t:b, left:r] for t, b, left, r in crop_boxes(h, w, pas)]
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
            seen += len(want) > 0
    assert seen >= 4
    assert crop_boxes(100, 700, replace(pas, enabled=False)) == []


def test_per_request_equals_transformers(gemma3):
    """An engine without pan-and-scan: a request's mm_processor_kwargs turn it on (a wide
    image gets 2 crops, a square one none, two images in one prompt), or leave it off; all
    in one batch, each request's ids, pixels and tokens transformers'."""
    path, hf, proc, llm = gemma3
    wide, square, tall = smooth_image(300, 700, seed=1), smooth_image(300, 300, seed=2), smooth_image(800, 270, seed=3)
    cases = [(TEXT, [wide], ON, [2]), (TEXT, [square], ON, [0]), (TEXT, [wide], None, [0]),
             (TWO, [tall, wide], {**ON, "pan_and_scan_max_num_crops": 2}, [2, 2])]
    outs = llm.generate([_prompt(proc, t, ims, kw) for t, ims, kw, _ in cases], GREEDY, use_tqdm=False)
    for out, (text, ims, kw, crops) in zip(outs, cases, strict=True):
        _check(llm, hf, proc, text, ims, kw, out, crops)
    assert outs[0].prompt_token_ids != outs[2].prompt_token_ids  # the same image, crops or not
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_engine_wide_equals_transformers(gemma3, tmp_path):
    """preprocessor_config.json's do_pan_and_scan (and crop settings) engine-wide: a wide,
    a tall and a square image; a request's do_pan_and_scan false turns it off; the same
    settings as LLM(mm_processor_kwargs=...) give the same tokens; `inspect` counts the crops'
    rows."""
    from flashpage.config import ModelConfig
    from flashpage.inspect import inspect_config

    path, hf, proc, _ = gemma3
    wide_path = edited_copy(path, tmp_path / "pas")
    pc = json.loads((wide_path / "preprocessor_config.json").read_text())
    (wide_path / "preprocessor_config.json").write_text(json.dumps({**pc, **SMALL}))
    llm = cpu_llm(wide_path, max_model_len=320)
    wide, tall, square = smooth_image(40, 150, seed=4), smooth_image(120, 40, seed=5), smooth_image(60, 60, seed=6)
    cases = [(TEXT, [wide], None, [3]), (TEXT, [tall], None, [3]), (TEXT, [square], None, [0]),
             (TEXT, [wide], {"do_pan_and_scan": False}, [0])]
    outs = llm.generate([_prompt(proc, t, ims, kw) for t, ims, kw, _ in cases], GREEDY, use_tqdm=False)
    for out, (text, ims, kw, crops) in zip(outs, cases, strict=True):
        _check(llm, hf, proc, text, ims, SMALL if kw is None else kw, out, crops)
    other = cpu_llm(path, max_model_len=320, mm_processor_kwargs=SMALL)
    assert _tokens(other.generate([_prompt(proc, t, ims, kw) for t, ims, kw, _ in cases], GREEDY,
                                  use_tqdm=False)) == _tokens(outs)
    info = inspect_config(ModelConfig.from_hf(str(wide_path)), 1 << 30, "fp32", image_size=(150, 40))
    assert info["vision"]["image_tokens"] == 4 * TOKENS
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_chunks_never_cut_a_crop_and_caches_keep_them_apart(gemma3, monkeypatch):
    """Budgets that would end a chunk inside a crop: each step's image rows are whole
    images; the plain image and its pan-and-scan'd form in turn on one engine with the
    prefix and encoder caches: each request's tokens transformers', their chain digests
    apart, the pan-and-scan'd request's cached tokens never past the prompts' common text,
    and a repeat of it served from both caches."""
    path, hf, proc, _ = gemma3
    llm = cpu_llm(path, max_model_len=256, max_num_batched_tokens=24, enable_prefix_caching=True)
    runner = llm.engine.runner
    seen: list[tuple[int, ...]] = []
    prepare = runner.prepare

    def spy(out):
        inp = prepare(out)
        seen.extend(inp.metadata.bidirectional)
        return inp

    monkeypatch.setattr(runner, "prepare", spy)
    wide = smooth_image(300, 700, seed=7)
    plain, pas = _prompt(proc, TEXT, [wide]), _prompt(proc, TEXT, [wide], ON)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in (plain, pas, plain, pas)]
    _check(llm, hf, proc, TEXT, [wide], None, outs[0], [0])
    _check(llm, hf, proc, TEXT, [wide], ON, outs[1], [2])
    assert _tokens(outs[2:]) == _tokens(outs[:2])
    assert seen and all(pos + rows == hi and rows == TOKENS for _, _, rows, pos, _, hi in seen)
    enc = llm.engine.mm_encoder
    inputs = [enc.prepare(list(p["prompt_token_ids"]), p["multi_modal_data"], v)[1]
              for p, v in ((plain, None), (pas, replace(enc.config, pan_and_scan=PanAndScan(True))))]
    assert len(inputs[0]) == 1 and len(inputs[1]) == 3
    assert chain_digest(inputs[0]) != chain_digest(inputs[1])
    common = next(i for i, (a, b) in enumerate(zip(outs[0].prompt_token_ids, outs[1].prompt_token_ids,
                                                    strict=False)) if a != b)
    assert outs[1].metrics.num_cached_tokens <= common < inputs[1][0].offset
    assert outs[3].metrics.num_cached_tokens > inputs[1][-1].offset  # a hit past its last crop
    cache = runner.encoder_cache
    assert cache is not None and cache.hits >= 1  # the whole image's rows: the plain one's pixels
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_bad_values_are_refused_by_name_and_leak_nothing(gemma3, tmp_path):
    """Per request: bad pan-and-scan values and unknown keys named, the batch's others run;
    crops past max_model_len refused (before any is resized where their rows alone pass it);
    no block kept. A checkpoint without a tokenizer cannot write the crops' text: a request
    whose image gets crops is refused, one whose image gets none runs."""
    path, hf, proc, llm = gemma3
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    wide = smooth_image(300, 700, seed=8)
    bad = [({"do_pan_and_scan": "yes"}, "do_pan_and_scan must be true or false"),
           ({**ON, "pan_and_scan_max_num_crops": 0}, "pan_and_scan_max_num_crops must be a positive int"),
           ({**ON, "pan_and_scan_min_crop_size": -4}, "pan_and_scan_min_crop_size must be a positive int"),
           ({**ON, "pan_and_scan_min_ratio_to_activate": "1.2"}, "pan_and_scan_min_ratio_to_activate"),
           ({**ON, "max_pixels": 100}, "['max_pixels']")]
    small = cpu_llm(path, max_model_len=64)
    outs = small.generate([_prompt(proc, TEXT, [smooth_image(260, 1031, seed=9)],
                                   {**ON, "pan_and_scan_min_crop_size": 60}),
                           _prompt(proc, TEXT, [wide], ON), _prompt(proc, TEXT, [wide])], GREEDY, use_tqdm=False)
    # 4 crops: refused before they are resized; 2: the prompt (48 rows and the text) too long
    assert "pan-and-scan cuts it into 4 crops, 80 rows with the whole image, more than max_model_len 64" \
        in outs[0].error
    assert "max_model_len is 64" in outs[1].error and outs[2].error is None
    assert small.engine.kv_manager.stats().blocks_used == 0
    batch = [_prompt(proc, TEXT, [wide], ON), *(_prompt(proc, TEXT, [wide], kw) for kw, _ in bad),
             _prompt(proc, TEXT, [wide])]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needle) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs and needle in out.error, out.error
    good = [outs[0], outs[-1]]
    assert _tokens(good) == _tokens(llm.generate([batch[0], batch[-1]], GREEDY, use_tqdm=False))
    assert len(good[0].prompt_token_ids) > len(good[1].prompt_token_ids) + 2 * TOKENS
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()
    bare = cpu_llm(build_tiny_gemma3(Path(tmp_path) / "bare", tokenizer=False), max_model_len=256)
    ids = [1, 5, bare.engine.mm_encoder.config.boi_token_id, 6]
    outs = bare.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [im]},
                           "mm_processor_kwargs": ON} for im in (wide, smooth_image(300, 300, seed=10))],
                         GREEDY, use_tqdm=False)
    assert "pan-and-scan crops need the model's tokenizer" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == MAX_NEW
    assert bare.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pan_and_scan_bf16_on_the_gpu_agrees_with_transformers(tmp_path):
    """bf16 on CUDA (triton backend, decode graphs captured): pan-and-scan'd prompts (wide,
    tall, square, two images) engine-wide give graphed tokens equal to eager ones, and
    teacher-forced on our tokens transformers' fp32 top-1 agrees with ours at least as often
    as its own bf16 does (3 points of slack) and >= 85%."""
    path = build_tiny_gemma3(tmp_path / "g3_64", text=dict(head_dim=64, hidden_size=128,
                                                           query_pre_attn_scalar=64))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = hf_gemma3(path).to("cuda")
    hf16 = hf_gemma3(path).to("cuda", torch.bfloat16)
    images = [smooth_image(40 + 7 * i, 150 - 9 * i, seed=i) if i % 3 == 0 else
              smooth_image(130 - 5 * i, 41, seed=i) if i % 3 == 1 else smooth_image(60, 60, seed=i)
              for i in range(12)]
    prompts = [{"prompt_token_ids": tok.encode(TEXT if i % 4 else TWO),
                "multi_modal_data": {"image": [im] if i % 4 else [im, images[(i + 1) % 12]]}}
               for i, im in enumerate(images)]

    def run(**kw):
        from flashpage import LLM

        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  max_num_batched_tokens=64, max_model_len=320, mm_processor_kwargs=SMALL, **kw)
        return llm.generate(prompts, GREEDY, use_tqdm=False), llm

    graphed, llm = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    eager, _ = run(enforce_eager=True)
    assert _tokens(graphed) == _tokens(eager)
    enc = llm.engine.mm_encoder
    assert sum(o.prompt_token_ids.count(enc.config.image_token_id) for o in graphed) > 20 * TOKENS

    def mm_inputs(i, x):
        admitted = [enc.admit_image(im, j) for j, im in enumerate(prompts[i]["multi_modal_data"]["image"])]
        pixels = torch.stack([normalize(px, enc.config.processing) for a in admitted for px in a.images])
        return {"token_type_ids": (x == hf.config.image_token_index).long(), "pixel_values": pixels}

    assert_top_one_agreement("gemma3 pan-and-scan", hf, hf16, graphed, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
