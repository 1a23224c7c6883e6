"""Image input through the engine (engine/multimodal.py, models/llava.py): greedy tokens
equal transformers' LlavaForConditionalGeneration.generate with the same pixel values (one
image, two, a batch mixing text-only and image requests, chunked prefill cutting an image's
rows, preemption), the prefix cache shares an image's blocks only with the same image (the
text before it with any request), and
bad requests are refused by name without costing anyone else anything. fp32, CPU; one
CUDA test with graphs (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.models.clip_image import preprocess
from flashpage.pooling import PoolingParams
from flashpage.sampling_params import BeamSearchParams
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.conftest import random_prompts
from tests.llava_checkpoint import build_tiny_llava, hf_llava, hf_llava_greedy, smooth_image

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
TOKENS = 16  # rows per image of the tiny tower


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    hf = hf_llava(path)
    return path, hf, hf.config.image_token_index


def _pixels(llm_or_vc, images) -> torch.Tensor:
    vc = llm_or_vc.engine.mm_encoder.config if isinstance(llm_or_vc, LLM) else llm_or_vc
    return torch.stack([preprocess(im, vc.processing) for im in images])


def _expanded(ids: list[int], tok: int) -> list[int]:
    out: list[int] = []
    for t in ids:
        out += [tok] * TOKENS if t == tok else [t]
    return out


def _case(tok: int, seed: int, n_images: int, before: int = 5, after: int = 6):
    """(prompt ids with n <image> placeholders, the images)."""
    text = random_prompts(1, before + after, before + after, seed=seed)[0]
    text = [t % 200 + 3 for t in text]  # plain tokens, never the image token
    ids = [1, *text[:before]]
    for i in range(n_images):
        ids += [tok, *text[before + i: before + i + 2]]
    ids += text[before + n_images * 2:]
    images = [smooth_image(30 + 7 * i + seed, 44 - 3 * i, seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _want(hf, tok, ids, images, llm, max_new=MAX_NEW):
    return hf_llava_greedy(hf, _expanded(ids, tok), _pixels(llm, images) if images else None, max_new)


def test_one_and_two_images_equal_transformers(llava):
    path, hf, tok = llava
    llm = _llm(path)
    one_ids, one_img = _case(tok, 1, 1)
    two_ids, two_img = _case(tok, 2, 2)
    outs = llm.generate([{"prompt_token_ids": one_ids, "multi_modal_data": {"image": one_img[0]}},
                         {"prompt_token_ids": two_ids, "multi_modal_data": {"image": two_img}}],
                        GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, tok, one_ids, one_img, llm), _want(hf, tok, two_ids, two_img, llm)]
    assert outs[0].prompt_token_ids == _expanded(one_ids, tok)  # as LlavaProcessor's ids
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_text_prompt_pixel_values_and_expanded_ids(llava):
    """The same request as text with "<image>", as pixel values [3, S, S] (and a batch
    [n, 3, S, S]), and as ids already expanded: the same tokens."""
    path, hf, tok = llava
    llm = _llm(path)
    img = smooth_image(50, 35, seed=4)
    text = "USER: <image>\nthe quick brown fox ASSISTANT:"
    ids = llm.get_tokenizer().encode(text)
    assert ids.count(tok) == 1
    want = _want(hf, tok, ids, [img], llm)
    px = _pixels(llm, [img])
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"image": px[0]}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"image": px}},
                         {"prompt_token_ids": _expanded(ids, tok), "multi_modal_data": {"image": [img]}}],
                        GREEDY, use_tqdm=False)
    assert _tokens(outs) == [want] * 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_with_chunked_prefill(llava, monkeypatch, async_scheduling):
    """Text-only and image requests in the same steps, prompts cut into chunks of 12 tokens
    (an image's 16 rows always split across steps); the tower runs once per image."""
    path, hf, tok = llava
    llm = _llm(path, max_num_batched_tokens=12, async_scheduling=async_scheduling)
    cases = [_case(tok, 10 + i, i % 3) for i in range(6)]  # 0, 1 or 2 images each
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode

    def spy(data):
        encoded.append(len(data))
        return encode(data)

    monkeypatch.setattr(enc, "encode", spy)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, tok, ids, ims, llm) for ids, ims in cases]
    assert sum(encoded) == sum(len(ims) for _, ims in cases)  # each image once
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_preemption_keeps_the_rows(llava, monkeypatch):
    path, hf, tok = llava
    cases = [_case(tok, 20 + i, 1 + i % 2, before=3, after=4) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = _llm(path, block_size=4, num_gpu_blocks=48, max_num_batched_tokens=32,
               enable_prefix_caching=False)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: encoded.append(len(data)) or encode(data))
    free = llm.engine.kv_manager.num_free_blocks
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}} for ids, ims in cases],
                        params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [_want(hf, tok, ids, ims, llm, 24) for ids, ims in cases]
    assert sum(encoded) == sum(len(ims) for _, ims in cases)  # recomputed without encoding again
    assert llm.engine.kv_manager.num_free_blocks == free


def test_prefix_cache_shares_blocks_only_with_the_same_image(llava, monkeypatch):
    """A second request with the same image (another PIL object of the same pixels) hits
    the blocks of the first (and its tower does not run: all of its rows' blocks came from
    the cache); one with another image hits only the text blocks before the image, as a
    text-only request with that text does; tokens are transformers' throughout."""
    path, hf, tok = llava
    llm = _llm(path)
    kv = llm.engine.kv_manager
    ids, (img,) = _case(tok, 30, 1, before=7, after=20)  # 1 + 7 + 16 + 22 = 46 tokens: 5 full blocks
    other = smooth_image(img.size[1], img.size[0], seed=99)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: encoded.append(len(data)) or encode(data))

    def run(image):
        return _tokens(llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}],
                                    GREEDY, use_tqdm=False))[0]

    first = run(img)
    assert first == _want(hf, tok, ids, [img], llm)
    hits = kv.prefix_hits
    assert run(img.copy()) == first
    assert kv.prefix_hits - hits == 40  # its 5 full blocks
    assert encoded == [1]  # the image's positions all hit: never encoded the second time
    hits = kv.prefix_hits
    assert run(other) == _want(hf, tok, ids, [other], llm)
    assert kv.prefix_hits - hits == 8  # block 0: the 8 tokens before the image
    hits = kv.prefix_hits
    text_only = ids[:8] + [5, 6, 7, 8, 9]  # the text before the image, then other text
    assert _tokens(llm.generate([text_only], GREEDY, use_tqdm=False)) == \
        [hf_llava_greedy(hf, text_only, None, MAX_NEW)]
    assert kv.prefix_hits - hits == 8
    assert kv.stats().blocks_used == 0


def test_text_blocks_before_an_image_come_from_text_requests(llava):
    """The other way round: a text-only request's blocks serve an image request with the
    same text before its image, up to the block the image starts in (that block, half
    text, is the image request's own)."""
    path, hf, tok = llava
    llm = _llm(path)
    kv = llm.engine.kv_manager
    ids, (img,) = _case(tok, 31, 1, before=11, after=8)  # the image at 12: in block 1
    text = ids[:12] + [tok % 200 + 7] * 12  # 24 tokens: blocks 0-2 full, block 1 holds ids[8:12]
    assert _tokens(llm.generate([text], GREEDY, use_tqdm=False)) == [hf_llava_greedy(hf, text, None, MAX_NEW)]
    hits = kv.prefix_hits
    got = _tokens(llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY,
                               use_tqdm=False))
    assert got == [_want(hf, tok, ids, [img], llm)]
    assert kv.prefix_hits - hits == 8  # block 0 only
    assert kv.stats().blocks_used == 0


def test_n_samples_share_one_encoding(llava, monkeypatch):
    path, hf, tok = llava
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: encoded.append(len(data)) or encode(data))
    ids, ims = _case(tok, 40, 1)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}],
                       SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                       use_tqdm=False)[0]
    want = _want(hf, tok, ids, ims, llm)
    assert [o.token_ids for o in out.outputs] == [want] * 3
    assert encoded == [1]


def test_bad_requests_are_refused_by_name_and_leak_nothing(llava):
    path, hf, tok = llava
    llm = _llm(path, max_model_len=64)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    ids, ims = _case(tok, 50, 1)
    img = ims[0]
    plain = [i for i in ids if i != tok]
    broken = torch.zeros(3, 28, 28)
    broken[0, 0, 0] = float("nan")
    bad = [
        ({"prompt_token_ids": plain, "multi_modal_data": {"image": img}}, ["0 image token(s)", "1 image(s)"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}}, ["1 image token(s)", "2 image(s)"]),
        ({"prompt_token_ids": ids}, ["image tokens", "no image was given"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 20, 20)}}, ["[3, 28, 28]", "[3, 20, 20]"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 28, 28, dtype=torch.uint8)}},
         ["float pixel values", "uint8"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": broken}}, ["inf or NaN"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": "cat.png"}}, ["image 0 is a str"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"video": img}}, ["'video'", "\"image\" only"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": []}}, ["empty list"]),
        ({"prompt_token_ids": ids, "multi_modal_data": [img]}, ["must be a dict"]),
        ({"prompt_token_ids": ids + [5] * 40, "multi_modal_data": {"image": img}}, ["max_model_len is 64"]),
    ]
    good = _case(tok, 51, 1)
    batch = [{"prompt_token_ids": good[0], "multi_modal_data": {"image": good[1]}}, *(b for b, _ in bad), plain]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens([outs[0], outs[-1]]) == [_want(hf, tok, good[0], good[1], llm), _want(hf, tok, plain, [], llm)]
    cut = SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=10)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], cut, use_tqdm=False)[0]
    assert "truncate_prompt_tokens=10 would cut" in out.error
    with pytest.raises(ValueError, match="only generation takes images"):
        llm.engine.add_request("x", ids, PoolingParams(), multi_modal_data={"image": img})
    with pytest.raises(ValueError, match="beam_search"):
        llm.beam_search([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_an_image_for_a_text_model_is_refused(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu", block_size=8)
    out = llm.generate([{"prompt_token_ids": [1, 5, 6], "multi_modal_data": {"image": torch.zeros(3, 4, 4)}}],
                       GREEDY, use_tqdm=False)[0]
    assert "takes no image input" in out.error and "LlamaForCausalLM is a text-only model" in out.error
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llava_on_the_gpu_with_graphs(tmp_path, monkeypatch):
    """fp32 on CUDA (triton backend, every graph kind captured): image steps run eagerly
    beside graphed decodes and text-only steps; tokens equal transformers' on the CPU and
    an eager engine's. (cuDNN's TF32 off: the patch convolution in full fp32, as the CPU's.)"""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = build_tiny_llava(tmp_path / "llava64", text=dict(num_attention_heads=4, num_key_value_heads=2,
                                                            head_dim=64, hidden_size=128))
    hf = hf_llava(path)
    tok = hf.config.image_token_index
    cases = [_case(tok, 60 + i, i % 3) for i in range(6)]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]

    def run(**kw):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="triton", block_size=16,
                  max_num_batched_tokens=64, **kw)
        return _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)), llm

    graphed, llm = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    eager, _ = run(enforce_eager=True)
    assert graphed == eager
    vc = llm.engine.mm_encoder.config
    assert graphed == [hf_llava_greedy(hf, _expanded(ids, tok), _pixels(vc, ims) if ims else None, MAX_NEW)
                       for ids, ims in cases]
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_what_is_not_supported_yet_is_refused(llava):
    """Weight updates (the tower is not written by them) and sleep mode (its memory is not
    released) say so rather than half-work."""
    path, _, _ = llava
    llm = _llm(path)
    with pytest.raises(ValueError, match="reload_weights: the model's vision tower"):
        llm.engine.reload_weights()
    with pytest.raises(ValueError, match="enable_sleep_mode with an image model"):
        _llm(path, enable_sleep_mode=True)


def test_random_weights_run_the_tower(llava):
    """A random-weights engine of a LLaVA config.json (benchmarks): its tower is built and
    initialized too, and an image request runs."""
    path, _, tok = llava
    llm = _llm(None, random_weights_config=str(path / "config.json"), tokenizer=str(path))
    ids, ims = _case(tok, 70, 1)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}], GREEDY,
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == MAX_NEW
    assert all(torch.isfinite(p).all() for p in llm.engine.mm_encoder.parameters())


def test_inspect_says_images_run(llava):
    from flashpage.config import ModelConfig
    from flashpage.inspect import format_report, inspect_config

    info = inspect_config(ModelConfig.from_hf(llava[0]), 1 << 30)
    assert info["image_input"] is True
    assert "LlavaForConditionalGeneration: its text model and image input" in format_report(info)


def test_warm_up_prompts_hold_no_image_token(llava):
    """The engine's warm-up (run at start-up on CUDA) steps through prompts of every id up to
    its chunk: an image model's must skip the image token (a prompt holding one needs an
    image: run 228's GPU tests failed at start-up on a tiny vocabulary)."""
    path, _, tok = llava
    llm = _llm(path, max_num_batched_tokens=512)
    assert llm.engine.model_config.vocab_size <= 512 and tok < llm.engine.model_config.vocab_size
    llm.engine.warm_up()
    assert llm.engine.kv_manager.stats().blocks_used == 0 and not llm.engine.has_unfinished_requests()


def test_limit_mm_per_prompt(llava):
    """vLLM's limit_mm_per_prompt: a prompt with more images than allowed is refused by
    name (nothing leaked, the others run); {"image": 0} serves the text model alone, its
    tower never loaded; a bad limit is a ConfigError at start-up; the CLI's two forms."""
    from flashpage.cli import _mm_limits
    from flashpage.config import ConfigError

    path, hf, tok = llava
    llm = _llm(path, limit_mm_per_prompt={"image": 1})
    one_ids, one_img = _case(tok, 1, 1)
    two_ids, two_img = _case(tok, 2, 2)
    outs = llm.generate([{"prompt_token_ids": two_ids, "multi_modal_data": {"image": two_img}},
                         {"prompt_token_ids": one_ids, "multi_modal_data": {"image": one_img}}],
                        GREEDY, use_tqdm=False)
    assert outs[0].error is not None and "2 image item(s) in one prompt" in outs[0].error
    assert "limit_mm_per_prompt allows 1" in outs[0].error
    assert _tokens(outs[1:]) == [_want(hf, tok, one_ids, one_img, llm)]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    text = _llm(path, limit_mm_per_prompt={"image": 0})
    assert text.engine.mm_encoder is None
    ids = random_prompts(1, 12, 12, seed=5)[0]
    assert _tokens(text.generate([ids], GREEDY, use_tqdm=False)) == [hf_llava_greedy(hf, ids, None, MAX_NEW)]
    got = text.generate([{"prompt_token_ids": one_ids, "multi_modal_data": {"image": one_img}}], GREEDY,
                        use_tqdm=False)[0]
    assert got.error is not None and "limit_mm_per_prompt allows 0" in got.error
    for bad, needle in (({"speech": 1}, "unknown modality 'speech'"), ({"image": -1}, "non-negative int"),
                        ([1], "must be a dict")):
        with pytest.raises(ConfigError, match=needle):
            _llm(path, limit_mm_per_prompt=bad)
    assert _mm_limits('{"image": 2}') == {"image": 2} == _mm_limits("image=2")
    assert _mm_limits("image=3,video=0") == {"image": 3, "video": 0}
