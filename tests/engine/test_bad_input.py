"""Bad input: a clear error naming the problem, other requests unaffected, no block leaked."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, EngineConfig
from flashpage.models.loader import ModelLoadError
from tests.conftest import hf_greedy, random_prompts


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_checkpoint, request):
    """Both schedulings: a token id of -1 must be refused, not taken for async
    scheduling's placeholder."""
    return LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu",
               max_model_len=64, block_size=8, async_scheduling=request.param)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n must be"),
    (dict(min_p=2.0), "min_p"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ("", "prompt is empty"),
    ([5, 300, 7], r"token id 300 at position 1 is outside the vocabulary \[0, 256\)"),
    ([5, -1], "token id -1 at position 1"),
    (list(range(3, 70)), "prompt has 67 tokens but max_model_len is 64"),
])
def test_bad_prompt_fails_alone(llm, tiny_checkpoint, prompt, message):
    good = random_prompts(2, 4, 12, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([good[0], prompt, good[1]], params, use_tqdm=False)
    assert outs[1].error is not None and outs[1].outputs == []
    import re

    assert re.search(message, outs[1].error), outs[1].error
    expected = hf_greedy(tiny_checkpoint("llama2_mha"), good, 6)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert llm.engine.kv_manager.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_engine_add_request_raises(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request("x", [1, 2, 999], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_prompt_too_long_for_whole_cache(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu",
              max_model_len=256, block_size=4, num_gpu_blocks=8)
    outs = llm.generate([list(range(3, 50)), [5, 6, 7]],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert outs[0].error and "8 blocks" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_folder_without_weights(tmp_path, tiny_checkpoint):
    import shutil

    src = tiny_checkpoint("llama2_mha")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(tmp_path), device="cpu")


def test_corrupt_weights(tmp_path, tiny_checkpoint):
    import shutil

    src = tiny_checkpoint("llama2_mha")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage-not-safetensors")
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(str(tmp_path), device="cpu")


def test_weights_missing_a_tensor(tmp_path, tiny_checkpoint):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("llama2_mha")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    sd = load_file(str(src / "model.safetensors"))
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["RwkvForCausalLM"], "vocab_size": 10}')
    with pytest.raises(ConfigError, match="RwkvForCausalLM.*not supported"):
        LLM(str(tmp_path), device="cpu")


def test_config_missing_fields(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 10}')
    with pytest.raises(ConfigError, match="missing required field.*hidden_size"):
        LLM(str(tmp_path), device="cpu")


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": [')
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("bs", [0, 3, 24, 512])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=bs)


def test_invalid_params_in_a_batch_fail_alone(llm, tiny_checkpoint):
    """SamplingParams are checked again when a request is added: one made invalid after
    construction fails with its message while the rest of the batch completes."""
    prompts = random_prompts(3, 4, 12, seed=12)
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    bad = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    bad.top_p = 0.0
    outs = llm.generate(prompts, [good, bad, good], use_tqdm=False)
    assert outs[1].error is not None and "top_p" in outs[1].error
    expected = hf_greedy(tiny_checkpoint("llama2_mha"), [prompts[0], prompts[2]], 5)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert llm.engine.kv_manager.stats().blocks_used == 0
