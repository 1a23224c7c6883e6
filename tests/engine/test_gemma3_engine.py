"""Gemma 3's images through the engine (models/gemma3_vision.py, attention/bidirectional.py,
the scheduler's image cut): greedy tokens equal transformers' Gemma3ForConditionalGeneration
.generate (its token_type_ids mask: an image's rows attend both ways) for one image, two
and text-only prompts in one batch, under chunked prefill budgets that would cut an image,
with prefix-cache hits inside an image and after a preemption; bad requests are refused by
name, costing no one else anything and leaking no block. fp32, CPU; one bf16 CUDA test."""

from __future__ import annotations

import os

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.models.gemma3_vision import expand_gemma3_images
from tests.conftest import assert_top_one_agreement, random_prompts
from tests.conftest import ok_tokens as _tokens
from tests.gemma3_checkpoint import TOKENS, build_tiny_gemma3, hf_gemma3, hf_gemma3_greedy
from tests.llava_checkpoint import smooth_image

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))
    return path, hf_gemma3(path)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "block_size": 8, "max_model_len": 256,
                             "attention_backend": "torch_native", **kw})


def _case(boi: int, seed: int, n_images: int, before: int = 5, after: int = 6):
    """(prompt ids with n <start_of_image>, the images)."""
    text = [t % 200 + 3 for t in random_prompts(1, before + after, before + after, seed=seed)[0]]
    ids = [1, *text[:before]]
    for i in range(n_images):
        ids += [boi, *text[before + i: before + i + 2]]
    ids += text[before + n_images * 2:]
    images = [smooth_image(40 + 9 * i + seed, 70 - 5 * i, seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _prompt(ids, images) -> dict:
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})}


def _want(hf, llm: LLM, ids, images, max_new: int = MAX_NEW) -> list[int]:
    enc = llm.engine.mm_encoder
    expanded = expand_gemma3_images(ids, enc.config, len(images))[0] if images else ids
    pixels = torch.stack([enc.pixel_values(im) for im in images]) if images else None
    return hf_gemma3_greedy(hf, expanded, pixels, max_new)


def test_images_and_text_in_one_batch_equal_transformers(gemma3):
    path, hf = gemma3
    llm = _llm(path)
    boi = llm.engine.mm_encoder.config.boi_token_id
    cases = [_case(boi, 1, 1), _case(boi, 2, 2), _case(boi, 3, 0), _case(boi, 4, 1, before=0)]
    outs = llm.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, *c) for c in cases]
    enc = llm.engine.mm_encoder
    assert outs[0].prompt_token_ids == expand_gemma3_images(cases[0][0], enc.config, 1)[0]
    assert outs[0].prompt_token_ids.count(enc.config.image_token_id) == TOKENS
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_the_image_mask_matters(gemma3):
    """Causal attention over the image rows would give other logits (and, for some of these
    prompts, other tokens) on this model: the tests above check the both-ways mask."""
    path, hf = gemma3
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    differ = 0
    for seed in range(4):
        ids, ims = _case(enc.config.boi_token_id, 80 + seed, 1 + seed % 2)
        expanded, _ = expand_gemma3_images(ids, enc.config, len(ims))
        t = torch.tensor([expanded])
        kw = dict(input_ids=t, attention_mask=torch.ones_like(t),
                  pixel_values=torch.stack([enc.pixel_values(im) for im in ims]))
        with torch.no_grad():
            causal = hf(**kw).logits[0, -1]
            both = hf(**kw, token_type_ids=(t == enc.config.image_token_id).long()).logits[0, -1]
            tokens = hf.generate(**kw, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)[0, len(expanded):].tolist()
        assert (causal - both).abs().max() > 1e-2
        differ += tokens != _want(hf, llm, ids, ims)
    assert differ >= 1


@pytest.mark.parametrize("budget", [17, 24, 40])
def test_chunked_prefill_never_cuts_an_image(gemma3, budget, monkeypatch):
    """Budgets that would end a chunk inside an image (16 rows): the chunk ends before it,
    the image comes whole in the next step; tokens unchanged; each step's image rows end at
    their image's end."""
    path, hf = gemma3
    llm = _llm(path, max_num_batched_tokens=budget, max_num_seqs=4)
    boi = llm.engine.mm_encoder.config.boi_token_id
    cases = [_case(boi, 10 + i, i % 3, before=3 + i) for i in range(5)]
    runner = llm.engine.runner
    seen: list[tuple[int, int, int, int, int, int]] = []
    prepare = runner.prepare

    def spy(out):
        inp = prepare(out)
        seen.extend(inp.metadata.bidirectional)
        return inp

    monkeypatch.setattr(runner, "prepare", spy)
    outs = llm.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, *c) for c in cases]
    assert seen and all(pos + rows == hi and rows == TOKENS for _, _, rows, pos, _, hi in seen)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_prefix_cache_hit_inside_an_image(gemma3, monkeypatch):
    """The same image prompt again: its blocks come from the cache, the last one partly
    inside the image (block 8, image of 16 rows from position 8): the chunk starts inside
    the image, whose cached K/V were computed whole; tokens unchanged. And a preempted
    request recomputes its image whole."""
    path, hf = gemma3
    llm = _llm(path, enable_prefix_caching=True)
    boi = llm.engine.mm_encoder.config.boi_token_id
    ids, ims = _case(boi, 20, 1, before=4, after=3)
    want = _want(hf, llm, ids, ims)
    assert _tokens(llm.generate([_prompt(ids, ims)], GREEDY, use_tqdm=False)) == [want]
    out = llm.generate([_prompt(ids, ims)], GREEDY, use_tqdm=False)[0]
    assert _tokens([out]) == [want]
    enc = llm.engine.mm_encoder
    start = expand_gemma3_images(ids, enc.config, 1)[1][0]
    assert out.metrics.num_cached_tokens > start  # the hit reaches into the image
    # preemption: a cache of few blocks, two image requests
    small = _llm(path, block_size=4, num_gpu_blocks=80, max_num_batched_tokens=40,
                 enable_prefix_caching=False)
    cases = [_case(boi, 30 + i, 1 + i % 2, before=3, after=4) for i in range(4)]
    outs = small.generate([_prompt(*c) for c in cases], SamplingParams(temperature=0.0, max_tokens=24,
                                                                       ignore_eos=True), use_tqdm=False)
    assert _tokens(outs) == [_want(hf, small, *c, max_new=24) for c in cases]
    assert small.engine.scheduler.num_preemptions > 0


def test_bad_requests_are_refused_by_name_and_leak_nothing(gemma3):
    path, hf = gemma3
    llm = _llm(path, max_model_len=64)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    vc = llm.engine.mm_encoder.config
    ids, ims = _case(vc.boi_token_id, 50, 1)
    img = ims[0]
    plain = [i for i in ids if i != vc.boi_token_id]
    bad = [
        (_prompt(plain, [img]), ["0 <start_of_image> token(s)", "1 image(s)"]),
        (_prompt(ids, [img, img]), ["1 <start_of_image> token(s)", "2 image(s)"]),
        (_prompt(ids + [vc.image_token_id], [img]), ["holds <image_soft_token>"]),
        ({"prompt_token_ids": plain + [vc.image_token_id]}, ["<image_soft_token>", "no image was given"]),
        (_prompt(ids, [torch.zeros(3, 20, 20)]), ["[3, 56, 56]", "[3, 20, 20]"]),
        (_prompt(ids, ["cat.png"]), ["image 0 is a str"]),
        (_prompt(ids + [5] * 40, [img]), ["max_model_len is 64"]),
    ]
    good = _case(vc.boi_token_id, 51, 1)
    batch = [_prompt(*good), *(b for b, _ in bad), {"prompt_token_ids": ids}]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    # a <start_of_image> without an image is text, as in transformers (nothing expanded)
    assert _tokens([outs[0], outs[-1]]) == [_want(hf, llm, *good), _want(hf, llm, ids, [])]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_an_image_longer_than_a_chunk_is_refused(gemma3):
    """An image must come in one chunk: a chunk cap below its rows refuses the request by
    name (the others run)."""
    path, hf = gemma3
    llm = _llm(path, max_num_batched_tokens=64, long_prefill_token_threshold=12)
    boi = llm.engine.mm_encoder.config.boi_token_id
    ids, ims = _case(boi, 60, 1)
    text, _ = _case(boi, 61, 0)
    outs = llm.generate([_prompt(ids, ims), _prompt(text, [])], GREEDY, use_tqdm=False)
    assert "must be computed in one chunk" in outs[0].error and "at most 12 tokens" in outs[0].error
    assert _tokens([outs[1]]) == [_want(hf, llm, text, [])]
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_limit_and_random_weights(gemma3):
    """limit_mm_per_prompt counts Gemma 3's images; a random-weights engine builds the tower."""
    path, _ = gemma3
    llm = _llm(path, limit_mm_per_prompt={"image": 1})
    ids, ims = _case(llm.engine.mm_encoder.config.boi_token_id, 70, 2)
    out = llm.generate([_prompt(ids, ims)], GREEDY, use_tqdm=False)[0]
    assert "limit_mm_per_prompt allows 1" in out.error
    rnd = _llm(None, random_weights_config=str(path / "config.json"), tokenizer=str(path))
    ids, ims = _case(rnd.engine.mm_encoder.config.boi_token_id, 71, 1)
    out = rnd.generate([_prompt(ids, ims)], GREEDY, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == MAX_NEW


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemma3_bf16_on_the_gpu_agrees_with_transformers(tmp_path):
    """bf16 on CUDA (triton backend, graphs captured; image steps eager): graphed tokens equal
    eager ones; teacher-forced on our tokens, transformers' fp32 top-1 agrees with ours at
    least as often as transformers' own bf16 does (3 points of slack) and >= 85%."""
    path = build_tiny_gemma3(tmp_path / "g3_64", text=dict(head_dim=64, hidden_size=128,
                                                           query_pre_attn_scalar=64))
    hf = hf_gemma3(path).to("cuda")
    hf16 = hf_gemma3(path).to("cuda", torch.bfloat16)
    boi = hf.config.boi_token_index
    cases = [_case(boi, 60 + i, i % 3) for i in range(16)]
    prompts = [_prompt(*c) for c in cases]

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  max_num_batched_tokens=64, max_model_len=256, **kw)
        return llm.generate(prompts, GREEDY, use_tqdm=False), llm

    graphed, llm = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    eager, _ = run(enforce_eager=True)
    assert _tokens(graphed) == _tokens(eager)
    enc = llm.engine.mm_encoder

    def mm_inputs(i, x):
        kw = {"token_type_ids": (x == hf.config.image_token_index).long()}
        if cases[i][1]:
            kw["pixel_values"] = torch.stack([enc.pixel_values(im) for im in cases[i][1]])
        return kw

    assert_top_one_agreement("gemma3", hf, hf16, graphed, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_images_on_the_triton_backend_interpreted(tmp_path):
    """Our Triton kernels run the causal pass (fused rotary + cache write, per-layer windows)
    and the image rows are recomputed after them: transformers' tokens, head_dim 64, an
    image's chunk beside a text prompt's."""
    pytest.importorskip("triton")
    path = build_tiny_gemma3(tmp_path / "g3_64", text=dict(num_attention_heads=2, num_key_value_heads=1,
                                                           head_dim=64, query_pre_attn_scalar=16))
    hf = hf_gemma3(path)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=16, attention_backend="triton",
              max_num_batched_tokens=32, max_model_len=128)
    boi = llm.engine.mm_encoder.config.boi_token_id
    cases = [_case(boi, 90, 1, before=3, after=2), _case(boi, 91, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([_prompt(*c) for c in cases], params, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, *c, max_new=4) for c in cases]
