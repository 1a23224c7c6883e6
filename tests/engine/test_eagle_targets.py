"""EAGLE heads over the targets beyond a dense 16-bit Llama (models/eagle.EAGLE_TARGETS: every
architecture of the Llama body). The head reads only the target's hidden states and its
16-bit embedding / LM head, so over quantized targets (an fp8 block-scaled checkpoint,
`quantization="fp8"` and `quantization="int4"` at load; CPU, fp32, torch_native) a head built
to predict the flat target exactly has every draft accepted. A Qwen3-MoE target's CPU tests
are test_eagle_draft's (parametrized over it); its GPU test (marked gpu: heads of 32, the
fused MoE kernel, CUDA graphs) is here. An MLA target is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import edited_copy
from tests.engine.test_eagle_draft import (
    LAYERS,
    _adds_nothing,
    _config,
    _ids,
    _llm,
    _moe_ckpts,
    _prompts,
    _save,
    _target_weights,
    check_on_the_gpu,
    eagle1_exact,
    eagle1_random,
)
from tests.engine.test_mtp_draft import _no_leak
from tests.models.test_fp8_checkpoints import build_fp8_checkpoint


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
    check_on_the_gpu(_moe_ckpts(tmp_path, heads=2, kv_heads=1, head_dim=32), monkeypatch, method)
