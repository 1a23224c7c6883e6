"""LLaVA-NeXT image input through the engine (models/llava_next.py on engine/multimodal.py):
greedy tokens equal transformers' LlavaNextForConditionalGeneration.generate for images of
several sizes and aspect ratios (one, two, a batch with a text-only prompt, chunked prefill
cutting an image's rows), a repeated image prompt hits the prefix cache, bad requests are
refused by name and leak nothing. fp32, CPU; one bf16 CUDA test with graphs."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.models.llava_next import AnyResImage, anyres_pixels
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.conftest import random_prompts
from tests.llava_checkpoint import smooth_image
from tests.llava_next_checkpoint import build_tiny_llava_next, hf_llava_next, hf_llava_next_greedy

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# (height, width): wide, tall, square, very wide (one grid row cut away), larger than a pinpoint
SIZES = [(20, 33), (45, 18), (30, 30), (9, 70), (90, 64)]


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory):
    path = build_tiny_llava_next(tmp_path_factory.mktemp("llava_next"))
    hf = hf_llava_next(path)
    return path, hf, hf.config.image_token_index


def _case(tok: int, seed: int, n_images: int, before: int = 4, after: int = 5):
    """(prompt ids with n <image> placeholders, the images: sizes from SIZES)."""
    text = [t % 200 + 3 for t in random_prompts(1, before + after, before + after, seed=seed)[0]]
    ids = [1, *text[:before]]
    for i in range(n_images):
        ids += [tok, *text[before + i: before + i + 2]]
    ids += text[before + n_images * 2:]
    images = [smooth_image(*SIZES[(seed + i) % len(SIZES)], seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _want(hf, tok, ids, images, llm, max_new=MAX_NEW):
    """transformers' tokens for ``ids`` with each <image> expanded to its image's rows."""
    vc = llm.engine.mm_encoder.config
    items = [anyres_pixels(im, vc) for im in images]
    expanded: list[int] = []
    k = 0
    for t in ids:
        if t == tok:
            expanded += [tok] * items[k].rows
            k += 1
        else:
            expanded.append(t)
    return hf_llava_next_greedy(hf, expanded, items or None, max_new)


def test_images_of_several_shapes_equal_transformers(next_ckpt):
    """One image, two of different aspect ratios, a text-only prompt, in one batch; then the
    same batch cut into steps of 16 tokens (each image's rows split across steps)."""
    path, hf, tok = next_ckpt
    cases = [_case(tok, 1, 1), _case(tok, 2, 2), (_case(tok, 3, 0)[0], []), _case(tok, 3, 1)]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]
    llm = _llm(path)
    want = [_want(hf, tok, ids, ims, llm) for ids, ims in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    rows = [anyres_pixels(im, llm.engine.mm_encoder.config).rows for im in cases[1][1]]
    assert len(set(rows)) == 2  # the two images give different counts
    assert len(outs[1].prompt_token_ids) == len(cases[1][0]) - 2 + sum(rows)
    assert llm.engine.kv_manager.stats().blocks_used == 0
    chunked = _llm(path, max_num_batched_tokens=16)
    enc = chunked.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert sum(encoded) == 4  # each image once
    assert chunked.engine.kv_manager.stats().blocks_used == 0


def test_prefix_cache_hit_on_a_repeated_image(next_ckpt):
    """The same image again (another PIL object of the same pixels) hits the first's blocks
    and its tower does not run; another image of the same size hits nothing."""
    path, hf, tok = next_ckpt
    llm = _llm(path)
    kv = llm.engine.kv_manager
    ids, (img,) = _case(tok, 4, 1, before=6, after=12)
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


def test_bad_requests_are_refused_by_name_and_leak_nothing(next_ckpt):
    path, hf, tok = next_ckpt
    llm = _llm(path, max_model_len=96)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    ids, (img,) = _case(tok, 5, 1)
    big = smooth_image(64, 64, seed=1)  # 88 rows: past max_model_len with the text
    good = _case(tok, 6, 1)
    bad = [
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 16, 16)}},
         ["LLaVA-NeXT takes PIL images", "[3, 16, 16]"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}}, ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": img}}, ["'video'", "\"image\" only"]),
        ({"prompt_token_ids": ids}, ["no image was given"]),
        ({"prompt_token_ids": ids + [5] * 10, "multi_modal_data": {"image": big}}, ["max_model_len is 96"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": AnyResImage(torch.zeros(3, 3, 16, 16), (20, 33), 52)}},
         ["an image of 20 x 33 has float tiles [5, 3, 16, 16]", "got [3, 3, 16, 16]"]),
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


def test_preprocessed_images_and_expanded_ids_are_kept(next_ckpt):
    """An AnyResImage given (as the server hands them over) and ids already expanded give
    the same tokens as the PIL image with one placeholder."""
    path, hf, tok = next_ckpt
    llm = _llm(path)
    ids, (img,) = _case(tok, 7, 1)
    item = anyres_pixels(img, llm.engine.mm_encoder.config)
    assert isinstance(item, AnyResImage)
    expanded = [x for t in ids for x in ([tok] * item.rows if t == tok else [t])]
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"image": item}},
                         {"prompt_token_ids": expanded, "multi_modal_data": {"image": [img]}}],
                        GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, tok, ids, [img], llm)] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llava_next_on_the_gpu_with_graphs_bf16(tmp_path, monkeypatch):
    """bf16 on CUDA (triton backend, graphs captured): image steps run eagerly beside graphed
    decodes, tokens equal an eager engine's; against transformers, teacher-forced on fp32
    transformers' greedy continuations (greedy bf16 runs of a tiny random model part
    chaotically once one token differs: tests/conftest.bf16_teacher_forced_hits), our bf16
    top tokens agree with the fp32 ones as often as transformers' bf16 do."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = build_tiny_llava_next(tmp_path / "next64", text=dict(head_dim=64, hidden_size=128))
    hf32 = hf_llava_next(path, device="cuda")
    tok = hf32.config.image_token_index
    cases = [_case(tok, 60 + i, i % 3) for i in range(6)]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]

    def llm16(**kw) -> LLM:
        return LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                   max_num_batched_tokens=128, **kw)

    graphed_llm = llm16()
    assert graphed_llm.engine.runner.graphs is not None, "decode graphs were not captured"
    graphed = _tokens(graphed_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert graphed == _tokens(llm16(enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    vc = graphed_llm.engine.mm_encoder.config
    truth = [_want(hf32, tok, ids, ims, graphed_llm) for ids, ims in cases]
    del hf32
    hf16 = hf_llava_next(path, dtype=torch.bfloat16, device="cuda")
    ours = theirs = total = 0
    for (ids, ims), t in zip(cases, truth, strict=True):
        items = [anyres_pixels(im, vc) for im in ims]
        expanded = [x for i, y in enumerate(ids) for x in
                    ([tok] * items[sum(z == tok for z in ids[:i])].rows if y == tok else [y])]
        kw = {}
        if items:
            most = max(it.pixels.shape[0] for it in items)
            px = torch.zeros(len(items), most, *items[0].pixels.shape[1:])
            for j, it in enumerate(items):
                px[j, :it.pixels.shape[0]] = it.pixels
            kw = {"pixel_values": px.to("cuda", torch.bfloat16),
                  "image_sizes": torch.tensor([list(it.size) for it in items], device="cuda")}
        seq = expanded + t
        with torch.no_grad():
            logits = hf16(input_ids=torch.tensor([seq], device="cuda"), **kw).logits[0]
        theirs += sum(a == b for a, b in zip(logits[len(expanded) - 1:-1].argmax(-1).tolist(), t, strict=True))
        out = graphed_llm.generate({"prompt_token_ids": ids + t, **({"multi_modal_data": {"image": ims}} if ims else {})},
                                   SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                                   use_tqdm=False)[0]
        assert out.error is None, out.error
        ours += sum(out.prompt_logprobs[i].rank == 1 for i in range(len(expanded), len(seq)))
        total += len(t)
    assert ours >= theirs - 0.03 * total and ours >= 0.85 * total, (ours, theirs, total)
    assert graphed_llm.engine.kv_manager.stats().blocks_used == 0
