"""The flex backend (PyTorch's FlexAttention over our paged cache) gives torch_native's
tokens: chunked prefill, decodes in the same step, prefix hits, sliding window."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from tests.conftest import random_prompts

pytest.importorskip("torch.nn.attention.flex_attention")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(path, backend, prompts):
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend=backend, block_size=8,
              num_gpu_blocks=48, max_num_batched_tokens=40)
    assert llm.engine.backend_name == backend
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.kv_manager.stats().blocks_used == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["head64_gqa", "mistral_window"])
def test_flex_matches_torch_native(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    prompts = random_prompts(4, 2, 60, seed=21)  # the 40-token budget chunks the long ones
    prompts.append(prompts[0][:24] + [9, 8, 7])  # shares 3 full blocks with prompt 0
    assert _run(path, "flex", prompts) == _run(path, "torch_native", prompts)


def test_flex_refuses_mla(tiny_mla_checkpoint):
    from flashpage.attention.registry import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="MLA is not supported by the flex backend"):
        LLM(str(tiny_mla_checkpoint("deepseek_v2")), device="cpu", attention_backend="flex")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_matches_torch_native_gpu_fp32(tiny_checkpoint):
    """Compiled FlexAttention on the GPU, fp32: the same tokens as torch_native."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(6, 2, 100, seed=22)
    prompts.append(prompts[0][:24] + [9, 8, 7])
    runs = []
    for backend in ("flex", "torch_native"):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend,
                  block_size=16, max_num_batched_tokens=64, enforce_eager=True)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1]
