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
