"""The model's generation_config.json as sampling defaults (flashpage/generation_config.py,
vLLM's --generation-config): what a request leaves unset, max_new_tokens as a cap, and its
end-of-turn tokens."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from flashpage import LLM, SamplingParams
from flashpage.cli import _json_object
from flashpage.config import ConfigError
from flashpage.generation_config import load_generation_defaults

KW = dict(device="cpu", dtype="float32", num_gpu_blocks=64, attention_backend="torch_native")


def _folder(tmp_path, **cfg):
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_what_is_read(tmp_path):
    d = _folder(tmp_path, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                do_sample=True, max_new_tokens=64, eos_token_id=[5, 7], bos_token_id=1)
    g = load_generation_defaults("auto", d)
    assert g.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert g.max_tokens == 64 and g.eos_token_ids == (5, 7) and g.source.endswith("generation_config.json")
    assert g.sampling_kwargs() == {**g.sampling, "max_tokens": 64}
    # vllm: no sampling defaults, the model's end-of-turn tokens kept
    v = load_generation_defaults("vllm", d)
    assert v.sampling == {} and v.max_tokens is None and v.eos_token_ids == (5, 7)
    # overrides over the file; a folder of its own; no file: nothing
    o = load_generation_defaults("auto", d, {"temperature": 0.2, "top_k": None})
    assert o.sampling["temperature"] == 0.2 and "top_k" not in o.sampling
    other = tmp_path / "other"
    other.mkdir()
    assert load_generation_defaults(str(other), d).sampling == {}
    assert load_generation_defaults("auto", None) == load_generation_defaults("auto", str(other))
    assert load_generation_defaults("auto", d, {"eos_token_id": 9}).eos_token_ids == (9,)


@pytest.mark.parametrize("cfg, match", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be a number"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"eos_token_id": ["x"]}, "eos_token_id must be token ids"),
])
def test_bad_values_are_named(tmp_path, cfg, match):
    with pytest.raises(ConfigError, match=match):
        load_generation_defaults("auto", _folder(tmp_path, **cfg))


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        load_generation_defaults(str(tmp_path / "missing"), None)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_generation_defaults("auto", None, [1])  # type: ignore[arg-type]
    (tmp_path / "generation_config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_generation_defaults("auto", str(tmp_path))
    assert _json_object('{"temperature": 0.5}') == {"temperature": 0.5}
    with pytest.raises(argparse.ArgumentTypeError):
        _json_object("[1]")


def test_the_engine_takes_the_models_defaults(tiny_checkpoint, tmp_path):
    """No SamplingParams: the file's greedy temperature and max_new_tokens; an eos id named
    only in the file ends the output where greedy decoding writes it."""
    src = tiny_checkpoint("llama2_mha")
    prompt = [5, 17, 33, 9, 100]
    plain = LLM(str(src), **KW)
    greedy = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(t for t in greedy[3:] if t not in greedy[:3] and t != 2)
    k = greedy.index(stop_at)
    d = tmp_path / "model"
    shutil.copytree(src, d)
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 8, "eos_token_id": [2, stop_at], "bos_token_id": 1}))
    llm = LLM(str(d), **KW)
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[:k + 1] and out.finish_reason == "stop"
    vllm_defaults = LLM(str(d), generation_config="vllm", **KW)
    assert vllm_defaults.get_default_sampling_params().temperature == 1.0  # SamplingParams' own
    assert stop_at in vllm_defaults.engine.eos_token_ids  # the model's end-of-turn tokens stay
