"""vLLM's per-request mm_processor_kwargs (a prompt dict's, LLM.chat's; config.request_mm_processing):
a request's tokens equal those of an engine given the same kwargs engine-wide (Qwen2-VL image
bounds, Qwen2.5-VL video fps and bounds, Qwen3-VL image size and video fps), mixed in one
batch with requests without them; one image under two bounds gives two inputs (different rows,
digests, encoder-cache entries and prefix-cache blocks); keys the processor does not read, bad
values and a max_pixels above the engine's (what its encoder memory was reserved for) refused
by name, the batch's other requests unaffected and no block leaked. fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from flashpage import SamplingParams
from tests.conftest import count_encodes as _spy
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.engine.test_qwen3_vl_video import _frames, _ids
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import MAX_PIXELS, build_tiny_qwen2_vl
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = 56 * 56  # a 84 x 112 image: 12 rows at the tiny checkpoints' bounds, 2 under this


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    built: dict[str, object] = {}

    def get(variant: str):
        if variant not in built:
            where = tmp_path_factory.mktemp(variant)
            built[variant] = build_tiny_qwen3_vl(where) if variant == "qwen3_vl" \
                else build_tiny_qwen2_vl(where, variant)
        return built[variant]

    return get


def _prompt(ids, data=None, kw=None) -> dict:
    return {"prompt_token_ids": ids, **({"multi_modal_data": data} if data else {}),
            **({"mm_processor_kwargs": kw} if kw is not None else {})}


def test_qwen2_vl_image_bounds_per_request_equal_engine_wide(paths, monkeypatch):
    """One image given with max_pixels 56 x 56 and without, and a text prompt, in one batch:
    2 rows and 12, each request's tokens those of an engine built with its setting; the two
    are distinct inputs (both encoded, different digests); run again, the prefix cache and
    the encoder cache serve each its own (the same tokens, no new encode)."""
    path = paths("qwen2_vl")
    llm, small, plain = _llm(path), _llm(path, mm_processor_kwargs={"max_pixels": SMALL}), _llm(path)
    enc = llm.engine.mm_encoder
    encoded = _spy(monkeypatch, enc)
    img = smooth_image(84, 112, seed=3)
    ids, text = _ids(enc, "i", 1), _ids(enc, "", 2)
    prompts = [_prompt(ids, {"image": img}, {"max_pixels": SMALL}), _prompt(ids, {"image": img}), _prompt(text)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    pad = enc.config.image_token_id
    assert [o.prompt_token_ids.count(pad) for o in outs] == [2, 12, 0]
    want = [small.generate([_prompt(ids, {"image": img})], GREEDY, use_tqdm=False)[0],
            *plain.generate(prompts[1:], GREEDY, use_tqdm=False)]
    assert _tokens(outs) == _tokens(want)
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in want]
    assert _tokens(outs)[0] != _tokens(outs)[1]  # the bound is what makes the first agree
    assert sum(encoded) == 2
    vision = llm.engine.model_config.vision
    from flashpage.config import request_mm_processing

    mine = request_mm_processing(llm.engine.model_config, {"max_pixels": SMALL}, ["image"])
    assert mine is not None and mine.processing.max_pixels == SMALL and vision.processing.max_pixels == MAX_PIXELS
    (a,), (b,) = enc.prepare(ids, {"image": img}, mine)[1], enc.prepare(ids, {"image": img})[1]
    assert (a.length, b.length) == (2, 12) and a.digest != b.digest
    kv = llm.engine.kv_manager
    hits = kv.prefix_hits
    again = llm.generate(prompts[:2][::-1], GREEDY, use_tqdm=False)[::-1]
    assert _tokens(again) == _tokens(outs)[:2]
    assert sum(encoded) == 2  # each prompt's blocks its own: every image row cached, no encode
    assert kv.prefix_hits - hits == sum((len(o.prompt_token_ids) - 1) // 8 * 8 for o in outs[:2])
    assert llm.engine.kv_manager.stats().blocks_used == 0
    # no prefix cache: the encoder cache gives each request its own image's rows
    bare = _llm(path, enable_prefix_caching=False)
    encoded = _spy(monkeypatch, bare.engine.mm_encoder)
    for _ in range(2):
        assert _tokens(bare.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(outs)
    assert sum(encoded) == 2


def test_qwen2_5_vl_video_fps_and_bounds_per_request_equal_engine_wide(paths):
    """Qwen2.5-VL: a video with fps 4 and max_pixels 56 x 56 per request beside the same
    video without them (24 fps, the checkpoint's bounds) and an image: the first's tokens
    equal an engine given those kwargs engine-wide (temporal positions step 2, 4 rows per
    frame group), the others an engine given none."""
    path = paths("qwen2_5_vl")
    kw = {"fps": 4, "max_pixels": SMALL}
    llm, wide, plain = _llm(path), _llm(path, mm_processor_kwargs=kw), _llm(path)
    enc = llm.engine.mm_encoder
    video, img = _frames(4, 84, 112, 7), smooth_image(60, 90, seed=9)
    ids = _ids(enc, "v", 3)
    prompts = [_prompt(ids, {"video": video}, kw), _prompt(ids, {"video": video}),
               _prompt(_ids(enc, "i", 4), {"image": img}, {})]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = [wide.generate([_prompt(ids, {"video": video})], GREEDY, use_tqdm=False)[0],
            *plain.generate(prompts[1:], GREEDY, use_tqdm=False)]
    assert _tokens(outs) == _tokens(want)
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in want]
    vpad = enc.config.video_token_id
    assert [o.prompt_token_ids.count(vpad) for o in outs[:2]] == [2 * 2, 2 * 12]
    from flashpage.config import request_mm_processing

    mine = request_mm_processing(llm.engine.model_config, {"fps": 4}, ["video"])
    fast, slow = enc.admit_video(video, 0, mine), enc.admit_video(video)
    tps = enc.config.tokens_per_second  # x 2 frames a temporal patch / fps
    assert (fast.time_step, slow.time_step) == (tps * 2 / 4, tps * 2 / 24)
    (a,), (b,) = enc.prepare(ids, {"video": video}, mine)[1], enc.prepare(ids, {"video": video})[1]
    assert a.digest != b.digest  # the same frames: the time step alone tells them apart
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_qwen3_vl_image_size_and_video_fps_per_request_equal_engine_wide(paths):
    """Qwen3-VL: an image with transformers' size form per request (64 x 64 pixels at most:
    2 rows) and a video with fps 0.5 (its timestamp text 1.0 and 5.0 seconds), beside the
    same without: tokens and prompts equal those of engines given each setting engine-wide."""
    path = paths("qwen3_vl")
    size = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}}
    llm, plain = _llm(path), _llm(path)
    by_size, by_fps = _llm(path, mm_processor_kwargs=size), _llm(path, mm_processor_kwargs={"fps": 0.5})
    enc = llm.engine.mm_encoder
    img, video = smooth_image(96, 128, seed=5), _frames(4, 64, 64, 2)
    iids, vids = _ids(enc, "i", 6), _ids(enc, "v", 7)
    prompts = [_prompt(iids, {"image": img}, size), _prompt(vids, {"video": video}, {"fps": 0.5}),
               _prompt(iids, {"image": img}), _prompt(vids, {"video": video})]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = [by_size.generate([_prompt(iids, {"image": img})], GREEDY, use_tqdm=False)[0],
            by_fps.generate([_prompt(vids, {"video": video})], GREEDY, use_tqdm=False)[0],
            *plain.generate(prompts[2:], GREEDY, use_tqdm=False)]
    assert _tokens(outs) == _tokens(want)
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in want]
    pad = enc.config.image_token_id
    assert [o.prompt_token_ids.count(pad) for o in outs[::2]] == [2, 12]
    tok = llm.get_tokenizer()
    fast, slow = tok.decode(outs[1].prompt_token_ids), tok.decode(outs[3].prompt_token_ids)
    assert "1.0 seconds" in fast and "5.0 seconds" in fast and "1.0 seconds" not in slow
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_bad_kwargs_refused_by_name_batch_mates_unaffected(paths):
    """Keys the processor does not read, bad values, bounds that cross, size beside
    max_pixels, and a max_pixels (or size longest_edge) above the engine's own for the
    modality the request holds: each prompt refused naming it, the batch's good prompts
    get their tokens, no block leaked. A bound above the engine's is fine for a modality the
    request does not hold (a text prompt), and within a raised engine-wide bound."""
    path = paths("qwen2_vl")
    llm = _llm(path, mm_processor_kwargs={"max_pixels": 84 * 84})
    enc = llm.engine.mm_encoder
    img = smooth_image(84, 112, seed=3)
    ids, text = _ids(enc, "i", 1), _ids(enc, "", 2)
    bad = [({"do_resize": False}, "read min_pixels, max_pixels, size and fps"),
           ({"max_pixels": 0}, "max_pixels must be a positive int"),
           ({"min_pixels": 10**5}, "min_pixels 100000 is above max_pixels 7056"),
           ({"fps": -1}, "fps must be a positive number"),
           ({"size": {"longest_edge": 4096}, "max_pixels": 4096}, "give size or max_pixels, not both"),
           ({"max_pixels": 112 * 112}, "max_pixels 12544 is above this engine's image max_pixels 7056"),
           ({"size": {"longest_edge": 112 * 112}}, "size longest_edge 12544 is above this engine's image"),
           ("big", "mm_processor_kwargs must be a dict")]
    good = [_prompt(ids, {"image": img}), _prompt(text, None, {"max_pixels": 112 * 112}),
            _prompt(ids, {"image": img}, {"max_pixels": SMALL})]
    free = llm.engine.kv_manager.num_free_blocks
    outs = llm.generate([_prompt(ids, {"image": img}, kw) for kw, _ in bad] + good, GREEDY, use_tqdm=False)
    for (kw, needle), o in zip(bad, outs, strict=False):
        assert o.error is not None and needle in o.error, (kw, o.error)
    assert "--mm-processor-kwargs" in outs[5].error  # how to raise the bound
    alone = _llm(path, mm_processor_kwargs={"max_pixels": 84 * 84}).generate(good, GREEDY, use_tqdm=False)
    assert _tokens(outs[len(bad):]) == _tokens(alone)
    assert llm.engine.kv_manager.num_free_blocks == free
    assert llm.engine.kv_manager.stats().blocks_used == 0
    big = _llm(path, mm_processor_kwargs={"max_pixels": 112 * 112})  # the bound raised: allowed
    (o,) = big.generate([_prompt(ids, {"image": img}, {"max_pixels": 112 * 112})], GREEDY, use_tqdm=False)
    assert o.error is None and o.prompt_token_ids.count(enc.config.image_token_id) == 12
    with pytest.raises(ValueError, match="mm_processor_kwargs with prompt_embeds"):
        llm.engine.add_request(None, torch.zeros(3, 64), GREEDY, mm_processor_kwargs={"fps": 2})


def test_other_families_and_text_models_check_the_same_keys(tmp_path):
    """A text-only model refuses a prompt's mm_processor_kwargs by name, its batch-mate
    runs; Gemma 3's do_pan_and_scan false changes nothing (None: the engine's settings)
    and true is the request's own config (pan-and-scan on); a prompt dict with an unknown key names
    mm_processor_kwargs among those it takes."""
    from flashpage.config import ConfigError, ModelConfig, request_mm_processing
    from tests.conftest import build_tiny_checkpoint
    from tests.gemma3_checkpoint import build_tiny_gemma3

    llm = _llm(build_tiny_checkpoint(tmp_path / "text", "llama2_mha"))
    outs = llm.generate([_prompt([1, 5, 6], None, {"max_pixels": SMALL}), _prompt([1, 5, 6])], GREEDY,
                        use_tqdm=False)
    assert outs[0].error is not None and "takes no images here" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8
    assert llm.engine.kv_manager.stats().blocks_used == 0
    (o,) = llm.generate([{"prompt_token_ids": [1, 2], "mm_kwargs": {}}], GREEDY, use_tqdm=False)
    assert o.error is not None and "'mm_processor_kwargs'" in o.error
    mc = ModelConfig.from_hf(build_tiny_gemma3(tmp_path / "gemma3"))
    assert request_mm_processing(mc, {"do_pan_and_scan": False}, ["image"]) is None
    mine = request_mm_processing(mc, {"do_pan_and_scan": True}, ["image"])
    assert mine is not None and mine.pan_and_scan.enabled and not mc.vision.pan_and_scan.enabled
    with pytest.raises(ConfigError, match="pan_and_scan_max_num_crops must be a positive int"):
        request_mm_processing(mc, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0}, ["image"])


def test_llm_chat_takes_mm_processor_kwargs(paths):
    """LLM.chat(..., mm_processor_kwargs=...): an image part resized under the call's bound,
    the tokens those of LLM.chat on an engine given it engine-wide."""
    path = paths("qwen2_vl")
    img = smooth_image(84, 112, seed=11)
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                         {"type": "text", "text": "what is it"}]}]
    got = _llm(path).chat(msgs, GREEDY, use_tqdm=False, mm_processor_kwargs={"max_pixels": SMALL})[0]
    want = _llm(path, mm_processor_kwargs={"max_pixels": SMALL}).chat(msgs, GREEDY, use_tqdm=False)[0]
    assert got.error is None and got.prompt_token_ids == want.prompt_token_ids
    assert _tokens([got]) == _tokens([want])


def test_bound_checked_per_modality_the_request_holds(paths):
    """An engine whose video bound (3136 pixels) is below its image bound (the checkpoint's
    18816): a request's max_pixels 18816 is fine for images, refused for a video (naming
    the video bound), and for a prompt holding both; fps alone never touches the bounds."""
    from dataclasses import replace

    from flashpage.config import ConfigError, ModelConfig, request_mm_processing

    mc = ModelConfig.from_hf(str(paths("qwen2_vl")))
    vc = mc.vision
    mc = replace(mc, vision=replace(vc, video_processing=replace(vc.processing, max_pixels=SMALL)))
    kw = {"max_pixels": MAX_PIXELS}
    mine = request_mm_processing(mc, kw, ["image"])
    assert mine is not None and (mine.processing.max_pixels, mine.video_processing.max_pixels) == (MAX_PIXELS,) * 2
    for held in (["video"], ["image", "video"]):
        with pytest.raises(ConfigError, match="max_pixels 18816 is above this engine's video max_pixels 3136"):
            request_mm_processing(mc, kw, held)
    fps = request_mm_processing(mc, {"fps": 2}, ["image", "video"])
    assert fps is not None and fps.video_fps == 2.0 and fps.video_processing.max_pixels == SMALL
    assert request_mm_processing(mc, {}, ["image"]) is None
