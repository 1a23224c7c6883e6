"""InternVL image input through the engine (models/internvl.py on engine/multimodal.py):
greedy tokens equal transformers' InternVLForConditionalGeneration.generate for an image of
one tile and one of several (a grid and its thumbnail), two images of different tile
counts in one prompt, a text-only prompt beside them, chunked prefill cutting an image's
rows, preemption; Qwen3, Qwen3-MoE, GPT-OSS and Llama text models too, and an InternLM2 one
in OpenGVLab's layout (InternVL2.5-8B's form); mm_processor_kwargs
tile bounds; a repeated image hits the prefix cache; bad requests are refused by name and
leak nothing. fp32, CPU; one bf16 CUDA test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.models.internvl import InternVLImage, expand_internvl_images, tile_image
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.conftest import random_prompts
from tests.internvl_checkpoint import (
    ROWS,
    build_tiny_internvl,
    hf_internvl,
    hf_internvl_greedy,
    hf_pixels,
)
from tests.llava_checkpoint import smooth_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# (height, width): 2 x 2 + thumbnail (5 tiles), one tile, 2 x 1 + thumbnail, 6 x 1 + thumbnail, 1 x 3 + thumbnail
SIZES = [(33, 33), (16, 16), (20, 40), (10, 90), (45, 18)]


@pytest.fixture(scope="module")
def ivl_ckpt(tmp_path_factory):
    path = build_tiny_internvl(tmp_path_factory.mktemp("internvl"))
    hf = hf_internvl(path)
    return path, hf, hf.config.image_token_id


def _case(tok: int, seed: int, n_images: int, before: int = 4, after: int = 5, first: int | None = None):
    """(prompt ids with n <IMG_CONTEXT> placeholders, the images: sizes from SIZES)."""
    text = [t % 200 + 3 for t in random_prompts(1, before + after, before + after, seed=seed)[0]]
    ids = [1, *text[:before]]
    for i in range(n_images):
        ids += [tok, *text[before + i: before + i + 2]]
    ids += text[before + n_images * 2:]
    k = seed if first is None else first
    images = [smooth_image(*SIZES[(k + i) % len(SIZES)], seed=seed * 10 + i) for i in range(n_images)]
    return ids, images


def _want(hf, ids, images, llm, max_new=MAX_NEW):
    """transformers' tokens for ``ids`` expanded as InternVLProcessor does, with the images'
    tiles as its pixel_values."""
    vc = llm.engine.mm_encoder.config
    items = [tile_image(im, vc) for im in images]
    expanded = expand_internvl_images(ids, vc, [it.rows for it in items])[0] if items else ids
    return hf_internvl_greedy(hf, expanded, items, max_new)


def test_images_equal_transformers_whole_and_chunked(ivl_ckpt):
    """An image of 5 tiles, one of 1, two of 3 and 7 tiles in one prompt, a text-only prompt,
    in one batch; then the same batch cut into steps of 16 tokens (each image's rows split
    across steps), each image through the tower once."""
    path, hf, tok = ivl_ckpt
    cases = [_case(tok, 1, 1, first=0), _case(tok, 2, 1, first=1), _case(tok, 3, 2, first=2),
             (_case(tok, 4, 0)[0], [])]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]
    llm = _llm(path)
    want = [_want(hf, ids, ims, llm) for ids, ims in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    # each placeholder: <img>, its tiles' rows, </img>
    assert [len(o.prompt_token_ids) - len(ids) for o, (ids, _) in zip(outs, cases, strict=True)] == \
        [5 * ROWS + 1, ROWS + 1, (3 + 7) * ROWS + 2, 0]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    chunked = _llm(path, max_num_batched_tokens=16)
    enc = chunked.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert sum(encoded) == 4  # each image once
    assert chunked.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_recomputes_images_without_encoding_again(ivl_ckpt, async_scheduling):
    """Few blocks and chunks of 16 tokens: preempted requests recompute their images' rows
    from the kept rows (each image through the tower once), tokens transformers', no block
    left behind."""
    path, hf, tok = ivl_ckpt
    llm = _llm(path, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=32, enable_prefix_caching=False,
               async_scheduling=async_scheduling)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    cases = [_case(tok, 20 + i, 1, first=i % 3) for i in range(4)] + [(_case(tok, 24, 0)[0], [])]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = llm.engine.kv_manager.num_free_blocks
    outs = llm.generate([{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
                         for ids, ims in cases], params, use_tqdm=False)
    if not async_scheduling:
        assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [_want(hf, ids, ims, llm, 16) for ids, ims in cases]
    assert sum(encoded) == 4
    assert llm.engine.kv_manager.num_free_blocks == free


@pytest.mark.parametrize("text", ["qwen3", "llama", "qwen3_moe", "gpt_oss"])
def test_other_text_models_equal_transformers(tmp_path, text):
    """InternVL3.5's Qwen3, Qwen3-MoE and GPT-OSS text models (GPT-OSS's sliding layers
    beside full ones) and a Llama one (InternVL2.5's converted InternLM2): one image of 3
    tiles and two in one prompt."""
    path = build_tiny_internvl(tmp_path / text, text=text)
    hf = hf_internvl(path)
    tok = hf.config.image_token_id
    llm = _llm(path)
    cases = [_case(tok, 11, 1, first=2), _case(tok, 12, 2, first=0)]
    want = [_want(hf, ids, ims, llm) for ids, ims in cases]
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}} for ids, ims in cases],
                        GREEDY, use_tqdm=False)
    assert llm.engine.model_config.model_type == text
    assert _tokens(outs) == want


def test_remote_layout_equals_transformers(ivl_ckpt, tmp_path):
    """OpenGVLab's remote-code layout of the checkpoint (InternVLChatModel): transformers'
    tokens (its InternVLForConditionalGeneration on the converted weights) for one image, two
    and a text-only prompt, and for a text prompt with vLLM's "<image>" placeholder (the -hf
    layout's prompts hold <IMG_CONTEXT>: "<image>" is text there); with use_thumbnail false the grid's tiles alone (no thumbnail),
    with dynamic_image_size false one tile, the rows those tiles make."""
    from tests.internvl_checkpoint import to_remote_layout

    path, hf, tok = ivl_ckpt
    remote = to_remote_layout(path, tmp_path / "remote")
    cases = [_case(tok, 31, 1, first=0), _case(tok, 32, 2, first=2), (_case(tok, 33, 0)[0], [])]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]
    llm = _llm(remote)
    assert llm.engine.model_config.multimodal_architecture == "InternVLChatModel"
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == [_want(hf, ids, ims, llm) for ids, ims in cases]
    # a text prompt with vLLM's "<image>" placeholder for this layout: <IMG_CONTEXT>'s tokens
    img = smooth_image(20, 40, seed=4)
    text = "the cat <image>\nsat on the mat"
    ids = llm.get_tokenizer().encode(text.replace("<image>", "<IMG_CONTEXT>"))
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == text and _tokens([out]) == [_want(hf, ids, [img], llm)]
    hf_layout = _llm(path).generate([{"prompt": text, "multi_modal_data": {"image": img}}], GREEDY,
                                    use_tqdm=False)[0]
    assert "0 image token(s) (<IMG_CONTEXT>, id 242) but 1 image(s)" in hf_layout.error  # its prompts hold that
    for edit, tiles in (({"use_thumbnail": False}, 4), ({"dynamic_image_size": False}, 1)):
        other = _llm(to_remote_layout(path, tmp_path / str(tiles), **edit))
        out = other.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids.count(tok) == tiles * ROWS  # 33 x 33: a 2 x 2 grid
        assert _tokens([out]) == [_want(hf, *cases[0], other)]


def test_remote_layout_over_internlm2_equals_llama(tmp_path):
    """InternVL2.5-8B's form: OpenGVLab's layout over an InternLM2 text model (renamed
    tensors, wqkv grouped per KV head, ``language_model.output`` its untied head), here a
    Llama one written as InternLM2: transformers' tokens over the Llama one, and ours over
    the same checkpoint with the Llama text model, for one image, two and a text prompt; and
    InternVL3-9B's form (an InternLM3 llm_config over the Llama tensors) the same."""
    from safetensors.torch import load_file

    from tests.internvl_checkpoint import to_remote_layout

    path = build_tiny_internvl(tmp_path / "llama", text="llama", tie_word_embeddings=False)
    hf = hf_internvl(path)
    tok = hf.config.image_token_id
    remote = to_remote_layout(path, tmp_path / "internlm2", internlm2=True)
    names = load_file(str(remote / "model.safetensors")).keys()
    assert {"language_model.output.weight", "language_model.model.layers.0.attention.wqkv.weight"} <= names
    llm = _llm(remote)
    mc = llm.engine.model_config
    assert (mc.multimodal_architecture, mc.architecture, mc.num_key_value_heads) == (
        "InternVLChatModel", "InternLM2ForCausalLM", 2)
    cases = [_case(tok, 41, 1, first=0), _case(tok, 42, 2, first=2), (_case(tok, 43, 0)[0], [])]
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == [_want(hf, ids, ims, llm) for ids, ims in cases]
    llama = _llm(to_remote_layout(path, tmp_path / "llama_remote"))
    assert llama.engine.model_config.architecture == "LlamaForCausalLM"
    assert _tokens(llama.generate(prompts, GREEDY, use_tqdm=False)) == got
    assert llm.engine.kv_manager.stats().blocks_used == 0
    # InternVL3-9B's form: an InternLM3 llm_config over Llama's names (its bias flags false)
    three = tmp_path / "llama_remote"
    cfg = json.loads((three / "config.json").read_text())
    llm_cfg = {k: v for k, v in cfg["llm_config"].items() if k not in ("attention_bias", "mlp_bias")}
    cfg["llm_config"] = {**llm_cfg, "architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3",
                         "qkv_bias": False, "bias": False}
    (three / "config.json").write_text(json.dumps(cfg))
    internlm3 = _llm(three)
    assert internlm3.engine.model_config.architecture == "InternLM3ForCausalLM"
    assert _tokens(internlm3.generate(prompts, GREEDY, use_tqdm=False)) == got


def test_prefix_cache_hit_on_a_repeated_image(ivl_ckpt):
    """The same image again (another PIL object of the same pixels) hits the first's blocks
    and its tower does not run; another image of the same size hits the text's block before
    it alone."""
    path, hf, tok = ivl_ckpt
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
    assert first == _want(hf, ids, [img], llm)
    n_prompt = len(ids) + 1 + tile_image(img, enc.config).rows
    hits = kv.prefix_hits
    assert run(img.copy()) == first
    assert kv.prefix_hits - hits == (n_prompt - 1) // 8 * 8  # every full block but a last token's
    assert encoded == [1]
    hits = kv.prefix_hits
    assert run(other) == _want(hf, ids, [other], llm)
    # the block of text before the image (<img> its last token) is shared, nothing after it
    assert kv.prefix_hits - hits == 8
    assert kv.stats().blocks_used == 0


def test_bad_requests_are_refused_by_name_and_leak_nothing(ivl_ckpt):
    path, hf, tok = ivl_ckpt
    llm = _llm(path, max_model_len=120)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    ids, (img,) = _case(tok, 6, 1, first=2)  # 20 x 40: 3 tiles
    good = _case(tok, 7, 2, first=1)
    big = smooth_image(10, 90, seed=1)  # 7 tiles, 112 rows: past max_model_len with the text
    vc = llm.engine.mm_encoder.config
    one = tile_image(smooth_image(16, 16), vc)
    bad = [
        ({"prompt_token_ids": ids, "multi_modal_data": {"speech": [img, img]}},
         ["multi_modal_data ['speech']: InternVL (InternVLForConditionalGeneration) takes \"image\" and \"video\""]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"audio": [img, img]}},
         ['multi_modal_data["audio"] given, but this model (InternVLForConditionalGeneration) takes no audio input']),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": torch.zeros(3, 16, 16)}},
         ["uint8 pixels [3, H, W]", "[3, 16, 16] float32"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": "cat.png"}}, ["image 0 is a str"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": [img, img]}},
         ["1 image token(s) (<IMG_CONTEXT>, id 242) but 2 image(s)"]),
        ({"prompt_token_ids": ids}, ["image tokens (<IMG_CONTEXT>, id 242) but no image was given"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": big}}, ["max_model_len is 120"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": InternVLImage(one.pixels, (20, 40), 16)}},
         ["image 0: an image of 20 x 40 has tiles [3, 3, 16, 16]", "got [1, 3, 16, 16]"]),
        ({"prompt_token_ids": ids, "multi_modal_data": {
            "image": InternVLImage(torch.full((1, 3, 16, 16), float("nan")), (16, 16), 16)}},
         ["image 0: pixel values hold inf or NaN"]),
    ]
    batch = [{"prompt_token_ids": good[0], "multi_modal_data": {"image": good[1]}}, *(b for b, _ in bad)]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    assert _tokens(outs[:1]) == [_want(hf, good[0], good[1], llm)]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_pixels_tiles_and_expanded_ids_are_kept(ivl_ckpt):
    """uint8 pixels [3, H, W], InternVLImage's given (uint8 tiles, and float pixel values)
    and ids already expanded give the PIL images' tokens, for an image alone and for two."""
    path, hf, tok = ivl_ckpt
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    vc = enc.config
    for ids, imgs in (_case(tok, 8, 1, first=3), _case(tok, 9, 2, first=4)):
        items = [tile_image(im, vc) for im in imgs]
        raw = [enc.admit_image(im, i).pixels for i, im in enumerate(imgs)]
        pixels = [torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous() for im in imgs]
        floats = [InternVLImage(hf_pixels(hf, [it])["pixel_values"], it.size, it.rows) for it in items]
        assert all(torch.equal(r, it.pixels) for r, it in zip(raw, items, strict=True))
        expanded = expand_internvl_images(ids, vc, [it.rows for it in items])[0]
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}},
                             {"prompt_token_ids": ids, "multi_modal_data": {"image": pixels}},
                             {"prompt_token_ids": ids, "multi_modal_data": {"image": items}},
                             {"prompt_token_ids": ids, "multi_modal_data": {"image": floats}},
                             {"prompt_token_ids": expanded, "multi_modal_data": {"image": imgs}}],
                            GREEDY, use_tqdm=False)
        assert _tokens(outs) == [_want(hf, ids, imgs, llm)] * 5


def test_a_text_prompt_and_no_image_limit(ivl_ckpt):
    """A text prompt holding <IMG_CONTEXT> (the tokenizer's special token) gives the ids'
    tokens; limit_mm_per_prompt {"image": 0, "video": 0} serves the text model alone (no
    tower loaded), its text tokens transformers' and an image refused by the limit."""
    path, hf, tok = ivl_ckpt
    llm = _llm(path)
    img = smooth_image(20, 40, seed=5)
    text = "the cat <IMG_CONTEXT>\nsat on the mat"
    ids = llm.get_tokenizer().encode(text)
    assert ids.count(tok) == 1
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(hf, ids, [img], llm)] * 2
    text_only = _llm(path, limit_mm_per_prompt={"image": 0, "video": 0})
    assert text_only.engine.mm_encoder is None
    plain = [1, 5, 6, 7, 8]
    outs = text_only.generate([{"prompt_token_ids": plain},
                               {"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY, use_tqdm=False)
    assert _tokens(outs[:1]) == [hf_internvl_greedy(hf, plain, [], MAX_NEW)]
    assert "1 image item(s) in one prompt, but limit_mm_per_prompt allows 0" in outs[1].error


def test_mm_processor_kwargs_bound_the_tiles(ivl_ckpt):
    """vLLM's mm_processor_kwargs as InternVLProcessor's call reads them (or by vLLM's names for
    the remote-code layout: max_dynamic_patch, dynamic_image_size): max_patches 2 makes
    a 33 x 33 image 1 tile (GotOcr2's count under the same bounds; 2 x 2 and a thumbnail by
    default), min_patches 6 makes it 2 x 3 and a thumbnail, crop_to_patches false one tile; transformers' tokens on those tiles;
    an unknown key or bad bounds are a ConfigError."""
    from flashpage.config import ConfigError
    from tests.internvl_checkpoint import hf_image_processor

    path, hf, tok = ivl_ckpt
    ids, (img,) = _case(tok, 13, 1, first=0)
    proc = hf_image_processor()
    for kw, tiles in (({"max_patches": 2}, 1), ({"min_patches": 6}, 7), ({"crop_to_patches": False}, 1),
                      ({"max_dynamic_patch": 2}, 1), ({"dynamic_image_size": False}, 1)):
        llm = _llm(path, mm_processor_kwargs=kw)
        names = {"max_dynamic_patch": "max_patches", "dynamic_image_size": "crop_to_patches"}
        want_tiles = proc.get_number_of_image_patches(
            33, 33, {"crop_to_patches": True, **{names.get(k, k): v for k, v in kw.items()}})
        assert want_tiles == tiles
        out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY,
                           use_tqdm=False)[0]
        assert out.prompt_token_ids.count(tok) == tiles * ROWS
        assert _tokens([out])[0] == _want(hf, ids, [img], llm)
    for bad, needle in (({"max_num": 4}, r"\['max_num'\].*reads min_patches"),
                        ({"max_dynamic_patch": 4, "max_patches": 4}, "give max_dynamic_patch or max_patches"),
                        ({"min_patches": 5, "max_patches": 2}, "min_patches 5 is above max_patches 2"),
                        ({"max_patches": 0}, "max_patches must be a positive int")):
        with pytest.raises(ConfigError, match=needle):
            _llm(path, mm_processor_kwargs=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_internvl_on_the_gpu_bf16(tmp_path, monkeypatch):
    """bf16 on CUDA (triton backend, graphs captured): tokens equal an eager engine's;
    against transformers, teacher-forced on fp32 transformers' greedy continuations (greedy
    bf16 runs of a tiny random model part chaotically once one token differs), our bf16
    top tokens agree with the fp32 ones as often as transformers' bf16 do."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = build_tiny_internvl(tmp_path / "ivl64", text_fields=dict(hidden_size=128, num_attention_heads=2,
                                                                         num_key_value_heads=1))  # head_dim 64
    hf32 = hf_internvl(path, device="cuda")
    tok = hf32.config.image_token_id
    cases = [_case(tok, 60 + i, i % 3, first=i) for i in range(8)]  # none, one and two images
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
               for ids, ims in cases]

    def llm16(**kw) -> LLM:
        return LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                   max_num_batched_tokens=128, **kw)

    graphed_llm = llm16()
    graphed = _tokens(graphed_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert graphed == _tokens(llm16(enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    vc = graphed_llm.engine.mm_encoder.config
    truth = [_want(hf32, ids, ims, graphed_llm) for ids, ims in cases]
    del hf32
    hf16 = hf_internvl(path, dtype=torch.bfloat16, device="cuda")
    ours = theirs = total = 0
    for (ids, ims), t in zip(cases, truth, strict=True):
        # teacher-forced up to a generated <IMG_CONTEXT> (the tiny vocabulary has it): in a
        # prompt it would be a placeholder without its image
        t = t[:t.index(tok)] if tok in t else t
        if not t:
            continue
        items = [tile_image(im, vc) for im in ims]
        expanded = expand_internvl_images(ids, vc, [it.rows for it in items])[0] if items else ids
        seq = expanded + t
        with torch.no_grad():
            logits = hf16(input_ids=torch.tensor([seq], device="cuda"), **hf_pixels(hf16, items)).logits[0]
        theirs += sum(a == b for a, b in zip(logits[len(expanded) - 1:-1].argmax(-1).tolist(), t, strict=True))
        out = graphed_llm.generate({"prompt_token_ids": ids + t, **({"multi_modal_data": {"image": ims}} if ims else {})},
                                   SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                                   use_tqdm=False)[0]
        assert out.error is None, out.error
        ours += sum(out.prompt_logprobs[i].rank == 1 for i in range(len(expanded), len(seq)))
        total += len(t)
    assert ours >= theirs - 0.03 * total and ours >= 0.85 * total, (ours, theirs, total)
    assert graphed_llm.engine.kv_manager.stats().blocks_used == 0


def test_per_request_processor_kwargs_refused_by_name(ivl_ckpt):
    """InternVL's tiling bounds are read engine-wide only: a request giving them is refused by
    name (never run with them silently ignored), its batch-mate runs, no block is leaked."""
    path, _, tok = ivl_ckpt
    llm = _llm(path)
    ids, images = _case(tok, 3, 1)
    want = _tokens(llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
                                SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False))
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images},
                          "mm_processor_kwargs": {"max_patches": 2}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
                        SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert outs[0].error is not None and "engine-wide only" in outs[0].error and "max_patches" in outs[0].error
    assert _tokens(outs[1:]) == want
    assert llm.engine.kv_manager.stats().blocks_used == 0
