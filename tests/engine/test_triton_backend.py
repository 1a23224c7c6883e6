"""The triton backend gives the torch_native backend's tokens (CPU: under the Triton
interpreter, fp32; GPU: fp32 exactly, bf16 closely)."""

from __future__ import annotations

import os

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.attention.registry import BackendUnavailable, select_backend
from flashpage.config import ModelConfig
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(path, backend, device, dtype, prompts, **kw):
    llm = LLM(str(path), dtype=dtype, device=device, attention_backend=backend, block_size=16,
              max_num_batched_tokens=32, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.backend_name == backend
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/kernels sets it)")
def test_triton_backend_matches_torch_native_interpreted(tiny_checkpoint, monkeypatch):
    pytest.importorskip("triton")
    path = tiny_checkpoint("qwen3_qknorm")  # head_dim 16 is below the kernels' 64
    cfg = ModelConfig.from_hf(path)
    with pytest.raises(BackendUnavailable, match="head_dim 16"):
        select_backend("triton", cfg, torch.device("cpu"), torch.float32)
    path = tiny_checkpoint("head64_gqa")
    # Decodes, a 40-token prompt chunked by the 32-token budget, and a prefix hit.
    prompts = random_prompts(2, 3, 40, seed=5)
    prompts.append(prompts[1][:33] + [7, 8])
    ref = _run(path, "torch_native", "cpu", "float32", prompts)
    got = _run(path, "triton", "cpu", "float32", prompts)
    assert got == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_matches_torch_native_gpu(tiny_checkpoint, dtype):
    """fp32: identical tokens (CUDA graphs included). bf16: the backends round differently,
    so greedy paths may part, but only where the reference's top two tokens were nearly
    tied, and the token we chose there must be the reference's runner-up."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(12, 1, 120, seed=9)
    prompts.append(prompts[3] + [5, 6, 7])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    ref_llm = LLM(str(path), dtype=dtype, device="cuda", attention_backend="torch_native",
                  block_size=16, max_num_batched_tokens=32)
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    del ref_llm
    got = _run(path, "triton", "cuda", dtype, prompts)
    if dtype == "float32":
        assert got == [o.outputs[0].token_ids for o in ref]
        return
    for g, r in zip(got, ref, strict=True):
        rt = r.outputs[0].token_ids
        diverge = next((i for i, (a, b) in enumerate(zip(g, rt, strict=True)) if a != b), None)
        if diverge is None:
            continue
        lp = r.outputs[0].logprobs[diverge]
        (t1, l1), (t2, l2) = lp.top
        assert g[diverge] == t2, "the triton backend chose a token outside the reference's top 2"
        assert l1 - l2 < 0.1, f"parted at a clear choice (gap {l1 - l2:.3f} nats)"
