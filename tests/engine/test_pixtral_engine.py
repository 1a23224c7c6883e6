"""Image input through the engine for a Pixtral tower (models/pixtral.py): greedy tokens
equal transformers' Mistral3ForConditionalGeneration / LlavaForConditionalGeneration
(pixtral-12b's layout) generate with one image and two of different sizes, a batch mixing
text-only prompts with chunked prefill cutting through an image's rows (its [IMG_BREAK] /
[IMG_END] rows included), a prefix-cache hit on a repeated image, LLM.chat with image
parts; bad requests refused by name, no KV block left behind. fp32, CPU; one CUDA test
with graphs in bf16 (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import assert_top_one_agreement
from tests.conftest import count_encodes as _spy
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.llava_checkpoint import smooth_image
from tests.pixtral_checkpoint import batch_pixels, build_tiny_pixtral, hf_greedy, hf_model

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    path = build_tiny_pixtral(tmp_path_factory.mktemp("mistral3"))
    return path, hf_model(path)


def _case(img_tok: int, seed: int, n_images: int, before: int = 4, after: int = 5):
    """(prompt ids with n [IMG] placeholders, the images: each of its own size / aspect)."""
    g = torch.Generator().manual_seed(seed)
    text = (torch.randint(3, 200, (before + after + 2 * n_images,), generator=g)).tolist()
    ids = [1, *text[:before]]
    for i in range(n_images):
        ids += [img_tok, *text[before + 2 * i: before + 2 * i + 2]]
    ids += text[before + 2 * n_images:]
    sizes = [(30, 44), (17, 9), (40, 40), (12, 31)]
    images = [smooth_image(*sizes[(seed + i) % 4], seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _want(hf, llm, out, images, max_new=MAX_NEW):
    """transformers' tokens for the engine's expanded prompt and the same pixel values."""
    enc = llm.engine.mm_encoder
    return hf_greedy(hf, out.prompt_token_ids, [enc.pixel_values(im) for im in images], max_new)


def _prompt(ids, images):
    given = images is not None and (not isinstance(images, list) or len(images) > 0)
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if given else {})}


@pytest.mark.parametrize("llava", [False, True])
def test_one_and_two_images_equal_transformers(mistral3, tmp_path, llava):
    path, hf = mistral3
    if llava:
        path = build_tiny_pixtral(tmp_path / "pixtral12b", llava=True)
        hf = hf_model(path)
    llm = _llm(path)
    tok = llm.engine.mm_encoder.config.image_token_id
    cases = [_case(tok, 1, 1), _case(tok, 2, 2)]
    outs = llm.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims) for o, (_, ims) in zip(outs, cases, strict=True)]
    vc = llm.engine.mm_encoder.config
    two = outs[1].prompt_token_ids
    assert two.count(vc.end_token_id) == 2 and two.count(vc.break_token_id) > 0
    # the server's length check counts each image's span without preprocessing it
    enc = llm.engine.mm_encoder
    assert len(two) - len(cases[1][0]) + 2 == sum(enc.image_rows(im) for im in cases[1][1])


def test_mixed_batch_with_chunked_prefill(mistral3, monkeypatch):
    """Text-only and image requests in the same steps, prompts cut into chunks of 7 tokens
    (every image's span, its break rows included, split across steps); each image is
    encoded once; tokens are transformers'."""
    path, hf = mistral3
    llm = _llm(path, max_num_batched_tokens=7)
    tok = llm.engine.mm_encoder.config.image_token_id
    cases = [_case(tok, 10 + i, i % 3) for i in range(5)]  # 0, 1 or 2 images each
    encoded = _spy(monkeypatch, llm.engine.mm_encoder)
    outs = llm.generate([_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, llm, o, ims) for o, (_, ims) in zip(outs, cases, strict=True)]
    assert sum(encoded) == sum(len(ims) for _, ims in cases)  # each image once
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_prefix_cache_hit_on_a_repeated_image(mistral3, monkeypatch):
    """The same image again (another PIL object of the same pixels) hits every full block of
    the first request and is not encoded again; another image hits only the text before."""
    path, hf = mistral3
    llm = _llm(path)
    kv = llm.engine.kv_manager
    tok = llm.engine.mm_encoder.config.image_token_id
    ids, (img,) = _case(tok, 0, 1, before=7, after=12)  # 30 x 44: 3 rows of 4 [IMG] + a break
    other = smooth_image(img.size[1], img.size[0], seed=99)
    encoded = _spy(monkeypatch, llm.engine.mm_encoder)

    def run(image):
        return llm.generate([_prompt(ids, [image])], GREEDY, use_tqdm=False)[0]

    first = run(img)
    assert _tokens([first]) == [_want(hf, llm, first, [img])]
    n = len(first.prompt_token_ids)
    hits = kv.prefix_hits
    assert _tokens([run(img.copy())]) == _tokens([first])
    assert n == 1 + 7 + 15 + 14 and kv.prefix_hits - hits == 32  # its 4 full blocks
    assert encoded == [1]  # every position of the image hit: never encoded the second time
    hits = kv.prefix_hits
    again = run(other)
    assert _tokens([again]) == [_want(hf, llm, again, [other])]
    assert kv.prefix_hits - hits == 8  # block 0: the 8 tokens before the image
    assert kv.stats().blocks_used == 0


def test_bad_requests_are_refused_by_name_and_leak_nothing(mistral3):
    path, hf = mistral3
    llm = _llm(path, max_model_len=48)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    vc = llm.engine.mm_encoder.config
    tok = vc.image_token_id
    ids, (img,) = _case(tok, 50, 1)
    plain = [i for i in ids if i != tok]
    broken = torch.zeros(3, 16, 16)
    broken[0, 0, 0] = float("nan")
    bad = [
        (_prompt(plain, [img]), ["0 image token(s)", "1 image(s)"]),
        (_prompt(ids, [img, img]), ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids}, ["image tokens", "no image was given"]),
        (_prompt(ids, torch.zeros(3, 12, 16)), ["multiples of 8", "[3, 12, 16]"]),
        (_prompt(ids, torch.zeros(3, 16, 16, dtype=torch.uint8)), ["float pixel values", "uint8"]),
        (_prompt(ids, broken), ["inf or NaN"]),
        (_prompt(ids, smooth_image(100, 2)), ["image 0 could not be read", "too extreme"]),
        (_prompt(ids, "cat.png"), ["image 0 is a str"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": img}}, ["'video'", "\"image\" only"]),
        (_prompt(ids + [vc.break_token_id], [img]), ["already expanded", "image 0's span"]),
        (_prompt(ids + [5] * 40, [img]), ["max_model_len is 48"]),
    ]
    good = _case(tok, 51, 1)
    outs = llm.generate([_prompt(*good), *(b for b, _ in bad), plain], GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens([outs[0], outs[-1]]) == [_want(hf, llm, outs[0], good[1]), _want(hf, llm, outs[-1], [])]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_llm_chat_takes_image_parts(mistral3):
    """LLM.chat's image_pil parts go where Mistral's template puts [IMG] (it loops over the
    content blocks): the same tokens as generate with the rendered prompt and the images."""
    path, _ = mistral3
    llm = _llm(path)
    a, b = smooth_image(30, 44, seed=5), smooth_image(12, 31, seed=6)
    conv = [{"role": "user", "content": [{"type": "text", "text": "the cat"},
                                         {"type": "image_pil", "image_pil": a},
                                         {"type": "text", "text": "and"},
                                         {"type": "image_pil", "image_pil": b}]}]
    out = llm.chat([conv], GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "the cat"}, {"type": "image"}, {"type": "text", "text": "and"},
        {"type": "image"}]}], tokenize=False)
    assert text.count("[IMG]") == 2
    ids = tok.encode(text, add_special_tokens=False)
    ref = llm.generate([_prompt(ids, [a, b])], GREEDY, use_tqdm=False)[0]
    assert _tokens([out]) == _tokens([ref]) and out.prompt_token_ids == ref.prompt_token_ids


def test_random_weights_run_the_tower(mistral3):
    """A random-weights engine of a Mistral3 config.json (benchmarks): the tower is built and
    initialized, an image request runs, its break / end rows are the random text model's."""
    path, _ = mistral3
    llm = _llm(None, random_weights_config=str(path / "config.json"), tokenizer=str(path))
    enc = llm.engine.mm_encoder
    ids, ims = _case(enc.config.image_token_id, 70, 1)
    out = llm.generate([_prompt(ids, ims)], GREEDY, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == MAX_NEW
    assert all(torch.isfinite(p).all() for p in enc.parameters())
    table = llm.engine.model.model.embed_tokens.weight
    (rows,) = enc.encode([enc.pixel_values(ims[0])])
    assert torch.equal(rows[-1], table[enc.config.end_token_id])
    assert not any(p is table for p in enc.parameters())  # the text model's, not the encoder's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pixtral_on_the_gpu_with_graphs(tmp_path):
    """bf16 on CUDA (triton backend, graphs captured): image steps run eagerly beside
    graphed decodes and text-only steps; tokens equal an eager engine's. Against transformers
    on the GPU, teacher-forced on our tokens: our token is fp32's top one about as often as
    transformers' own bf16 top token is (within 3 points, and at least 85%; run 232 had 4 of
    6 whole sequences equal transformers' bf16 generate, a tiny random model's near ties
    flipping either way)."""
    path = build_tiny_pixtral(tmp_path / "m3_64", text=dict(head_dim=64, hidden_size=128))
    hf = hf_model(path).to("cuda")
    hf16 = hf_model(path).to("cuda", torch.bfloat16)
    tok = hf.config.image_token_index
    cases = [_case(tok, 60 + i, i % 3) for i in range(32)]  # 256 tokens: agreement rates worth comparing
    prompts = [_prompt(*c) for c in cases]

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  max_num_batched_tokens=64, **kw)
        return llm.generate(prompts, GREEDY, use_tqdm=False), llm

    graphed, llm = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    eager, _ = run(enforce_eager=True)
    assert _tokens(graphed) == _tokens(eager)
    enc = llm.engine.mm_encoder

    def mm_inputs(i, x):
        if not cases[i][1]:
            return {}
        pv, sizes = batch_pixels([enc.pixel_values(im) for im in cases[i][1]])
        return {"pixel_values": pv, "image_sizes": sizes}

    assert_top_one_agreement("pixtral", hf, hf16, graphed, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
