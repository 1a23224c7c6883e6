"""InternLM2 / 2.5 (InternLM2ForCausalLM: Llama's body under renamed tensors and a wqkv
grouped per KV head, models/internlm2.py) and InternLM3 (Llama's names, its own bias flags).

transformers has no InternLM2 class (the hub's is remote code), so each tiny checkpoint is a
random Llama one written again in InternLM2's layout (tests/internlm2_checkpoint.py):
flashpage's greedy tokens from it equal transformers' Llama generate and flashpage's own
from the Llama files, under GQA (the grouping matters), MHA and MQA, with and without the
bias, and with internlm2_5-7b-chat's "dynamic" rope; weights come back from ``hf_weights``
under InternLM2's names and layout; a LoRA adapter on its modules equals the merged
checkpoint; a wqkv of the wrong row count, a missing tensor and config
fields are refused by name; ``flashpage inspect``'s counts for internlm2_5-7b-chat. CPU, fp32.
GPU (marked gpu): the Triton kernels and CUDA graphs give transformers' Llama tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import SamplingParams
from flashpage.config import ConfigError, ModelConfig, RopeScaling
from flashpage.models.common import regroup_qkv
from tests.conftest import (
    _checkpoints,
    assert_edit_refused,
    assert_missing_tensor_named,
    cpu_llm,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    save_widened,
)
from tests.internlm2_checkpoint import grouped_wqkv, to_internlm2

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, rope_theta=10_000.0)
# name -> LlamaConfig fields over _LLAMA
TINY = {
    "gqa": dict(num_key_value_heads=2),                       # 2 groups of 2 q heads
    "gqa_bias": dict(num_key_value_heads=2, attention_bias=True),  # bias: wqkv and wo
    "mha": dict(num_key_value_heads=4),                       # a group a head
    "mqa": dict(num_key_value_heads=1, num_attention_heads=8, hidden_size=64),  # one group
    # internlm2_5-7b-chat's rope: "dynamic" NTK (the plain rope within max_position_embeddings)
    "gqa_dynamic": dict(num_key_value_heads=2, rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                                    rope_theta=1e6)),
}


def build(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """The Llama checkpoint (``path``/llama) and the same weights in InternLM2's layout
    (``path``/internlm2); returns ``path``. ``overrides``: LlamaConfig fields."""
    config = transformers.LlamaConfig(**{**_LLAMA, **TINY[name], **overrides})
    save_widened(config, path / "llama", seed, lambda n: "norm" in n)
    to_internlm2(path / "llama", path / "internlm2")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build)


@pytest.mark.parametrize("name", sorted(TINY))
def test_greedy_tokens_equal_llama_in_transformers_and_ours(tiny, name):
    """InternLM2's files give transformers' Llama tokens and ours from the Llama files; the
    prompt logprobs equal too."""
    path = tiny(name)
    prompts = random_prompts(3, 4, 30, seed=1)
    want = hf_greedy(path / "llama", prompts, GREEDY.max_tokens)
    llm = cpu_llm(path / "internlm2")
    mc = llm.engine.model_config
    assert mc.architecture == "InternLM2ForCausalLM"
    if name == "gqa_dynamic":
        raw = json.loads((path / "internlm2" / "config.json").read_text())
        assert raw["rope_scaling"] == {"type": "dynamic", "factor": 2.0}
        assert (mc.rope_theta, mc.rope_scaling) == (1e6, None)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    if name == "gqa_dynamic":  # (our Llama reads no "dynamic" rope: transformers' tokens suffice)
        return
    ours_llama = [o.outputs[0].token_ids for o in cpu_llm(path / "llama").generate(prompts, GREEDY, use_tqdm=False)]
    assert ours_llama == want
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    a = llm.generate([prompts[0]], params, use_tqdm=False)[0].prompt_logprobs[1:]
    b = cpu_llm(path / "llama").generate([prompts[0]], params, use_tqdm=False)[0].prompt_logprobs[1:]
    torch.testing.assert_close(torch.tensor([x.logprob for x in a]), torch.tensor([x.logprob for x in b]),
                               atol=1e-5, rtol=1e-5)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_grouped_layout_is_not_ours(tiny):
    """Under GQA the checkpoint's wqkv rows differ from our [q | k | v] (the grouping is
    exercised), and regroup_qkv turns them into exactly Llama's q, k, v."""
    from safetensors.torch import load_file

    path = tiny("gqa_bias")
    llama = load_file(str(path / "llama" / "model.safetensors"))
    ours = torch.cat([llama[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    wqkv = load_file(str(path / "internlm2" / "model.safetensors"))["model.layers.0.attention.wqkv.weight"]
    assert not torch.equal(wqkv, ours)
    assert torch.equal(regroup_qkv(wqkv, 2, 16, to_ours=True), ours)
    bias = torch.cat([llama[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(regroup_qkv(grouped_wqkv(*bias.split([64, 32, 32]), 2), 2, 16, to_ours=True), bias)


@pytest.mark.parametrize("name", ["gqa_bias", "mqa"])
def test_weights_round_trip_under_internlm2_names(tiny, name):
    """hf_weights gives back every tensor under InternLM2's name, wqkv grouped again; our
    modules are Llama's."""
    model, ref = load_and_round_trip(tiny(name) / "internlm2", head="output.weight")
    assert "model.layers.1.attention.wqkv.weight" in ref
    assert ("model.layers.1.attention.wqkv.bias" in ref) == (name == "gqa_bias")
    assert ("model.layers.1.attention.wo.bias" in ref) == (name == "gqa_bias")
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    assert model.hf_name("model.layers.0.mlp.gate_up_proj") == "model.layers.0.mlp.gate_up_proj"
    targets = model.lora_targets()
    assert {"model.layers.0.attention.wqkv", "model.layers.0.attention.wo", "model.layers.0.feed_forward.w1",
            "model.layers.0.feed_forward.w3", "model.layers.0.feed_forward.w2"} <= set(targets)


def test_bad_wqkv_shape_and_missing_tensor_named(tiny, tmp_path):
    src = tiny("gqa") / "internlm2"
    name = "model.layers.1.attention.wqkv.weight"

    def cut(t):
        t[name] = t[name][:-16]

    assert_edit_refused(src, tmp_path / "cut", cut,
                        r"model\.layers\.1\.attention\.wqkv\.weight: checkpoint shape \(112, 64\) does not have "
                        r"\(4 query \+ 2 x 2 KV heads\) x 16 = 128 rows")
    assert_missing_tensor_named(src, tmp_path / "missing", "model.layers.0.feed_forward.w3.weight")


def _internlm2(**kw) -> dict:
    return {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, **kw}


def test_internlm2_config_fields():
    """``bias`` defaults to true (InternLM2Config's) and biases wqkv and wo, never the MLP;
    rope "dynamic" is the plain rope, "linear" Llama's; others refused."""
    c = ModelConfig.from_hf(_internlm2())
    assert (c.attention_bias, c.o_proj_bias, c.mlp_bias) == (True, True, False)
    c = ModelConfig.from_hf(_internlm2(bias=False, rope_theta=1e6, max_position_embeddings=32768,
                                       rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert (c.attention_bias, c.o_proj_bias, c.rope_scaling, c.rope_theta) == (False, False, None, 1e6)
    c = ModelConfig.from_hf(_internlm2(rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    with pytest.raises(ConfigError, match=r"rope_scaling type 'yarn' is not supported for InternLM2ForCausalLM"):
        ModelConfig.from_hf(_internlm2(rope_scaling={"type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match=r"rope_scaling 'dynamic' needs a factor >= 1, got None"):
        ModelConfig.from_hf(_internlm2(rope_scaling={"type": "dynamic"}))
    with pytest.raises(ConfigError, match=r"hidden_act 'gelu' is not supported for InternLM2ForCausalLM"):
        ModelConfig.from_hf(_internlm2(hidden_act="gelu"))
    assert ModelConfig.from_hf({k: v for k, v in _internlm2().items() if k != "architectures"}
                               ).architecture == "InternLM2ForCausalLM"


def test_internlm3_config_fields():
    """InternLM3: ``qkv_bias`` on q/k/v only, o_proj unbiased; ``bias`` true (o_proj and the
    MLP) refused; its "dynamic" rope (internlm3-8b-instruct's, factor 6) the plain rope."""
    d = {**_internlm2(), "architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3", "head_dim": 32,
         "qkv_bias": True, "bias": False, "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}}
    c = ModelConfig.from_hf(d)
    assert (c.attention_bias, c.o_proj_bias, c.head_dim, c.rope_scaling) == (True, False, 32, None)
    c = ModelConfig.from_hf({**d, "qkv_bias": False})
    assert (c.attention_bias, c.o_proj_bias) == (False, False)
    with pytest.raises(ConfigError, match=r"bias true is not supported for InternLM3ForCausalLM"):
        ModelConfig.from_hf({**d, "bias": True})


def test_internlm3_gives_llama_tokens(tiny, tmp_path):
    """InternLM3's files are Llama's tensors under Llama's names: relabelled, the same tokens."""
    import shutil

    src = tiny("gqa") / "llama"
    dst = tmp_path / "internlm3"
    shutil.copytree(src, dst)
    llama = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({
        **{k: v for k, v in llama.items() if k != "attention_bias"}, "architectures": ["InternLM3ForCausalLM"],
        "model_type": "internlm3", "qkv_bias": False, "bias": False,
        "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}}))
    prompts = random_prompts(2, 4, 30, seed=2)
    got = [o.outputs[0].token_ids for o in cpu_llm(dst).generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(src, prompts, GREEDY.max_tokens)


def test_inspect_counts_internlm2_5_7b():
    """internlm2_5-7b-chat's config: the parameters of the Llama model of its sizes
    (transformers, meta device; 7.74 B) and its KV bytes a token (8 KV heads of 128)."""
    from flashpage.inspect import inspect_config, param_counts

    raw = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False,
           "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_hidden_layers": 32, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "rope_scaling": {"type": "dynamic", "factor": 2.0},
           "vocab_size": 92544, "tie_word_embeddings": False}
    ours = ModelConfig.from_hf(raw)
    llama = transformers.LlamaConfig(**{k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                            "num_key_value_heads", "num_hidden_layers", "vocab_size",
                                                            "tie_word_embeddings")})
    with torch.device("meta"):
        want = transformers.LlamaForCausalLM(llama).num_parameters()
    total, active = param_counts(ours)
    assert total == active == want and round(total / 1e9, 2) == 7.74
    assert inspect_config(ours, 80 * 2**30)["kv_bytes_per_token"] == 2 * 8 * 128 * 2 * 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gqa_bias", "mqa"])
def test_gpu_fp32_kernels_and_graphs_give_llama_tokens(tmp_path, name):
    """head_dim 64 (hidden 256 over 4 heads; MQA 8 heads of 32): our Triton attention from the
    regrouped wqkv, eager and in CUDA graphs, gives transformers' Llama fp32 tokens."""
    from tests.conftest import assert_gpu_graphs_match_hf

    path = build(tmp_path, name, hidden_size=256)
    llm = assert_gpu_graphs_match_hf(path / "internlm2", random_prompts(8, 1, 120, seed=28),
                                     reference=lambda _p, prompts, n: hf_greedy(path / "llama", prompts, n))
    assert llm.engine.model_config.architecture == "InternLM2ForCausalLM"


def test_lora_adapter_on_internlm2_modules_equals_merged(tiny, tmp_path):
    """A PEFT adapter on InternLM2's own modules (wqkv, its lora_B rows in the grouped
    layout; wo, w1, w3, w2) gives our tokens of the checkpoint with it merged (whose wqkv
    regroups at load as the tests above check against transformers), not the base's."""
    from flashpage import LoRARequest
    from tests.peft_adapter import merge_adapter, write_named_adapter

    base = tiny("gqa_bias") / "internlm2"
    shapes = {"attention.wqkv": (64, 128), "attention.wo": (64, 64), "feed_forward.w1": (64, 128),
              "feed_forward.w3": (64, 128), "feed_forward.w2": (128, 64)}
    adapter = write_named_adapter(tmp_path / "adapter", {
        f"model.layers.{i}.{m}": s for i in range(2) for m, s in shapes.items()})
    merged = merge_adapter(base, adapter, tmp_path / "merged")
    prompts = random_prompts(2, 4, 30, seed=11)
    llm = cpu_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4)
    outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    assert got == [o.outputs[0].token_ids for o in cpu_llm(merged).generate(prompts, GREEDY, use_tqdm=False)]
    assert got != [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
