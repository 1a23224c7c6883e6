"""EAGLE heads over the targets beyond a dense 16-bit Llama (models/eagle.EAGLE_TARGETS: every
architecture of the Llama body): a Qwen3-MoE target (8 layers, layer 0 dense, top-3 of 8
experts), and quantized targets (an fp8 block-scaled checkpoint, `quantization="fp8"` and
`quantization="int4"` at load). The head reads only the target's hidden states and its
16-bit embedding / LM head, so on the CPU (fp32, torch_native): over the MoE target every
greedy draft equals the independent reference's (test_eagle_draft._Reference, the states
from transformers) and the tokens are plain decoding's; heads built to predict a flat
target exactly have every draft accepted over the MoE and the quantized targets alike.
GPU (marked gpu): the MoE target with heads of 32, the fused MoE kernel and CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashpage import SamplingParams
from tests.conftest import build_tiny_moe_checkpoint, edited_copy, random_prompts
from tests.engine.test_eagle_draft import (
    AUX,
    LAYERS,
    K,
    _adds_nothing,
    _config,
    _ids,
    _llm,
    _prompts,
    _Reference,
    _save,
    _target_weights,
    eagle1_exact,
    eagle1_random,
    eagle3_exact,
    eagle3_random,
)
from tests.engine.test_mtp_draft import _no_leak, spy_drafts
from tests.models.test_fp8_checkpoints import build_fp8_checkpoint

assert AUX[-1] < LAYERS


def _moe_ckpts(root: Path, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> dict[str, Path]:
    """A Qwen3-MoE target of 8 layers (H 64, vocab 256: the heads' shapes), its flat twin
    (attention and every expert's output zeroed: next token f(token)) and heads for both."""
    base = build_tiny_moe_checkpoint(root / "base", "qwen3_moe", num_hidden_layers=LAYERS,
                                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     head_dim=head_dim)
    flat = edited_copy(base, root / "flat", _adds_nothing)
    tw = _target_weights(flat)
    narrow = dict(heads=heads, kv_heads=kv_heads)
    return {
        "base": base, "flat": flat,
        "eagle": _save(root / "e1", eagle1_random(**narrow), _config("eagle", **narrow)),
        "eagle3": _save(root / "e3", eagle3_random(**narrow), _config("eagle3", **narrow)),
        "eagle_exact": _save(root / "e1x", eagle1_exact(tw, **narrow), _config("eagle", **narrow)),
        "eagle3_exact": _save(root / "e3x", eagle3_exact(tw),
                              _config("eagle3", heads=1, kv_heads=1, draft_vocab_size=256)),
    }


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _moe_ckpts(tmp_path_factory.mktemp("eagle_moe"))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_moe_target_drafts_equal_the_reference(moe, monkeypatch, method):
    """Random heads over the MoE target (batch 4, chunked prefill): every greedy draft equals
    the reference's (the routed layers' states from transformers), the tokens plain
    decoding's, no block leaked."""
    prompts = random_prompts(4, 4, 30, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = _ids(_llm(moe["base"]), prompts, params)
    seen = spy_drafts(monkeypatch)
    llm = _llm(moe["base"], moe[method], method, max_num_batched_tokens=20,
               spec={"backoff": False}, enable_prefix_caching=False)
    assert _ids(llm, prompts, params) == want
    ref = _Reference(moe["base"], moe[method], method)
    assert len(seen) >= 8
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), (len(tokens), drafts)
    _no_leak(llm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_exact_heads_over_the_moe_target_are_always_accepted(moe, method):
    prompts = _prompts()
    want = _ids(_llm(moe["flat"]), prompts)
    llm = _llm(moe["flat"], moe[f"{method}_exact"], method, max_num_batched_tokens=24)
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    assert st["mean_accepted_length"] > K
    _no_leak(llm)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A flat dense Llama target of 8 layers, its fp8 block-scaled checkpoint (the norms,
    embedding and LM head 16-bit) and the exact EAGLE-1 head over it."""
    from tests.conftest import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("eagle_quantized")
    base = build_tiny_checkpoint(root / "base", "llama31_gqa", num_hidden_layers=LAYERS)
    flat = edited_copy(base, root / "flat", _adds_nothing)
    build_fp8_checkpoint(flat, root / "fp8", root / "fp8_ref", "fp8_block",
                         is_linear=lambda name, w: name.endswith("_proj.weight"))
    return {"flat": flat, "fp8": root / "fp8",
            "exact": _save(root / "e1x", eagle1_exact(_target_weights(flat)), _config("eagle"))}


@pytest.mark.parametrize("target", ["fp8 checkpoint", "fp8 at load", "int4 at load"])
def test_exact_head_over_quantized_targets(quantized, target):
    """An fp8 block checkpoint (its quantization_config once refused), or the 16-bit target
    rounded to fp8 / int4 at load: the exact EAGLE-1 head (the target's own LM head over the
    embedding of the token fed) has every draft accepted, and the tokens are the same
    quantized target's plain decoding's."""
    path = quantized["fp8"] if target == "fp8 checkpoint" else quantized["flat"]
    kw = {} if target == "fp8 checkpoint" else {"quantization": target.split()[0]}
    want = _ids(_llm(path, **kw), _prompts())
    llm = _llm(path, quantized["exact"], "eagle", max_num_batched_tokens=24, **kw)
    if target == "fp8 checkpoint":
        assert llm.engine.model.config.quantization_config is not None
    assert _ids(llm, _prompts()) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)


def test_mla_targets_are_still_refused(tiny_mla_checkpoint, tmp_path):
    """An MLA target (DeepSeek) is not of the Llama body: a clear error naming it."""
    from flashpage.config import ConfigError

    head = _save(Path(tmp_path) / "e1", eagle1_random(), _config("eagle"))
    with pytest.raises(ConfigError, match="Llama-body targets"):
        _llm(tiny_mla_checkpoint("deepseek_v3"), head)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_moe_target_on_the_gpu_with_cuda_graphs(tmp_path, monkeypatch, method):
    """fp32 on the GPU, triton backend (the fused MoE kernel), heads of 32 (2 query heads,
    1 KV head) and the graphs captured: the exact head's drafts all accepted, the random
    head's every draft equal to the reference's, plain decoding's tokens."""
    ckpts = _moe_ckpts(tmp_path, heads=2, kv_heads=1, head_dim=32)
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=64)
    prompts = random_prompts(5, 5, 40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["flat"], **kw), prompts, params)
    llm = _llm(ckpts["flat"], ckpts[f"{method}_exact"], method, **kw)
    assert llm.engine.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)
    want = _ids(_llm(ckpts["base"], **kw), prompts, params)
    llm = _llm(ckpts["base"], ckpts[method], method, enable_prefix_caching=False,
               spec={"backoff": False}, **kw)
    seen = spy_drafts(monkeypatch)
    assert _ids(llm, prompts, params) == want
    ref = _Reference(ckpts["base"], ckpts[method], method)
    assert len(seen) >= 20
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), (len(tokens), drafts)
    _no_leak(llm)
