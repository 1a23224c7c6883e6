"""Qwen3-VL-MoE image input through the engine (Qwen3-VL's tower, deepstack and interleaved
M-RoPE over a Qwen3-MoE text model: routed experts in layers 0 and 2, a dense MLP in layer
1): greedy tokens equal transformers' generate (images of different sizes and a text-only
prompt in one batch; the published checkpoints' expert layout; chunked prefill cutting
through images, with preemption; a prefix-cache hit on a repeated image prompt), a bad
request refused by name without a leaked block. fp32, CPU; one CUDA test in bf16 (the fused
MoE kernel, CUDA graphs; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import assert_top_one_agreement, edited_copy
from tests.engine.test_qwen3_vl_engine import _case, _llm, _prompts, _spy, _tokens, _want
from tests.qwen2_vl_checkpoint import hf_qwen_greedy
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl, hf_qwen3_vl, hub_experts

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)
    return path, hf_qwen3_vl(path)


def test_images_and_text_equal_transformers(moe, tmp_path):
    """One image, two of different sizes, a text-only prompt, in one batch: transformers'
    tokens (layers 0 and 2 routed, layer 1 dense); the same checkpoint with its experts in the published files' layout
    ([E, H, 2I]) gives the same tokens, as transformers' reading of it does."""
    path, hf = moe
    llm = _llm(path)
    assert type(llm.engine.runner.model.model.layers[0].mlp).__name__ == "SparseMoeBlock"
    assert type(llm.engine.runner.model.model.layers[1].mlp).__name__ != "SparseMoeBlock"
    enc = llm.engine.mm_encoder
    cases = [_case(enc, 0, 1), _case(enc, 1, 2), _case(enc, 2, 0)]
    outs = llm.generate(_prompts(cases), GREEDY, use_tqdm=False)
    want = [_want(hf, llm, o, ims) for o, (_, ims) in zip(outs, cases, strict=True)]
    assert _tokens(outs) == want
    assert llm.engine.kv_manager.stats().blocks_used == 0
    hub = edited_copy(path, tmp_path / "hub", edit=hub_experts)
    hf_hub = hf_qwen3_vl(hub)
    assert torch.equal(hf_hub.model.language_model.layers[0].mlp.experts.gate_up_proj,
                       hf.model.language_model.layers[0].mlp.experts.gate_up_proj)
    got = _tokens(_llm(hub).generate(_prompts(cases), GREEDY, use_tqdm=False))
    assert got == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption_through_images(moe, monkeypatch, async_scheduling):
    """Chunks of 5 tokens (an image's rows, their deepstack features and their routing split
    across steps), few blocks: transformers' tokens, each image encoded once."""
    path, hf = moe
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
    assert sum(encoded) == sum(len(ims) for _, ims in cases)
    assert llm.engine.kv_manager.num_free_blocks == free


def test_prefix_cache_hit_and_a_bad_request(moe, monkeypatch):
    """The same image prompt again: every block but the last hit, the tower not run, the
    same tokens; a prompt whose image tokens do not match its images is refused by name
    beside a good request, nothing leaked."""
    path, hf = moe
    llm = _llm(path)
    kv = llm.engine.kv_manager
    enc = llm.engine.mm_encoder
    encoded = _spy(monkeypatch, enc)
    ids, images = _case(enc, 7, 1)
    prompt = {"prompt_token_ids": ids + list(range(40, 60)), "multi_modal_data": {"image": images}}
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert _tokens([first])[0] == _want(hf, llm, first, images)
    hits = kv.prefix_hits
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert _tokens([again]) == _tokens([first])
    assert kv.prefix_hits - hits == (len(first.prompt_token_ids) - 1) // 8 * 8 and encoded == [1]
    free = kv.num_free_blocks
    plain = [t for t in ids if t != enc.config.image_token_id]
    outs = llm.generate([{"prompt_token_ids": plain, "multi_modal_data": {"image": images}},
                         {"prompt_token_ids": plain}], GREEDY, use_tqdm=False)
    assert outs[0].error is not None and "0 image token(s)" in outs[0].error
    assert _tokens(outs[1:])[0] == hf_qwen_greedy(hf, plain, None, MAX_NEW)
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_vl_moe_on_the_gpu_bf16(tmp_path):
    """bf16 on CUDA (triton backend, the fused MoE kernel, CUDA graphs for decodes): tokens
    equal an eager engine's; teacher-forced on our tokens, our token is transformers' fp32
    top one about as often as transformers' own bf16 top token is (within 3 points, and at
    least 85%, as the dense Qwen3-VL test asks)."""
    path = build_tiny_qwen3_vl(tmp_path / "q3moe", moe=True, text=dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
        moe_intermediate_size=128, num_experts=8, intermediate_size=256,
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
    assert llm.engine.runner.model.model.layers[0].mlp.experts.fused_kernel
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

    assert_top_one_agreement("qwen3_vl_moe", hf, hf16, outs, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
