"""OPT (OPTForCausalLM: models/opt.py): learned positions read at position + 2, ReLU MLP,
pre-LN (OPT-125m and up) or post-LN with project_in / project_out (OPT-350m), LayerNorms
without parameters, no biases, no final norm (``_remove_final_layer_norm``), tied or
untied head; Llama's attention and loading under OPT's names.

CPU, fp32: greedy tokens and prompt logprobs equal transformers' for each shape (one on
our Triton kernels in the interpreter); chunked prefill, preemption and prefix hits;
generation ends at max_position_embeddings and a max_model_len past it is refused;
weights back under HF's names, the Hub's ``decoder.*`` file layout loads; a PEFT adapter on
OPT's module names gives the merged checkpoint's tokens; a missing tensor named as the
checkpoint names it; quantization="fp8" leaves project_in / project_out 16-bit;
``flashpage inspect``'s parameter counts (tiny checkpoints, and OPT-125m's 125,239,296 /
OPT-350m's shapes against transformers on the meta device) and KV bytes per token;
config fields and errors.
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens,
and bf16 follows fp32 about as far as transformers' bf16 does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import inspect_config, param_counts
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    assert_dense_params_match_hf,
    assert_gpu_graphs_match_hf,
    assert_missing_tensor_named,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    edited_copy,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    save_widened,
)
from tests.peft_adapter import assert_adapter_gives_merged_tokens, write_named_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MAX_POS = 128

# name -> config kwargs over the base (2 layers, hidden 64, 4 heads of 16, ffn_dim 128)
TINY: dict[str, dict] = {
    # OPT-125m's shape: pre-LN, ReLU, biases everywhere, a final norm, the head tied
    "opt": {},
    # OPT-350m's: post-LN (no final norm), embeddings of 32 projected in and out, tied
    "opt_350m": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
    # pre-LN without the final norm, LayerNorms without parameters, no biases, exact GELU,
    # an untied head
    "opt_bare": dict(_remove_final_layer_norm=True, layer_norm_elementwise_affine=False,
                     enable_bias=False, activation_function="gelu", tie_word_embeddings=False),
}
NAMES = sorted(TINY)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_config(name: str, **overrides) -> transformers.OPTConfig:
    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                num_attention_heads=4, max_position_embeddings=MAX_POS, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    return transformers.OPTConfig(**{**base, **TINY[name], **overrides})


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint, weights widened as conftest's builders do (far from ties)."""
    return save_widened(_hf_config(name, **overrides), path, seed, lambda n: "layer_norm" in n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=8,
               attention_backend="torch_native", **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _load(path: Path):
    return load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    prompts = random_prompts(3, 5, 60, seed=1)
    llm = _llm(path)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        path, prompts, GREEDY.max_tokens)
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves: each prompt token's logprob is transformers' log-softmax (the
    shapes are real: transformers built no final norm where the config says so)."""
    path = tiny(name)
    prompt = random_prompts(1, 60, 60, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = _llm(path).generate([prompt], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert (hf.model.decoder.final_layer_norm is None) == (name != "opt")
    assert (hf.model.decoder.project_in is not None) == (name == "opt_350m")
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    want = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["opt", "opt_350m"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: each chunk, recomputed prompt and cached prefix must read embed_positions at
    its own positions (+ 2) to give transformers' tokens."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


def test_greedy_on_our_kernels_matches_transformers(tmp_path):
    """The triton backend (our prefill and paged decode attention with no rotary) under
    OPT-350m's post-LN layers; on the CPU in the interpreter."""
    path = _gpu_checkpoint(tmp_path, "opt_350m")
    prompts = random_prompts(2, 20, 34, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    assert llm.engine.backend_name == "triton"
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == hf_greedy(
        path, prompts, params.max_tokens)


def test_generation_ends_at_max_position_embeddings(tiny):
    """embed_positions has max_position_embeddings + 2 rows, the last for position
    max_position_embeddings - 1: max_model_len defaults to max_position_embeddings, a
    larger one is a ConfigError naming it, and a run stops there with transformers'
    tokens (the last ones read the table's last rows)."""
    path = tiny("opt")
    with pytest.raises(ConfigError, match=r"max_model_len 129 is past OPTForCausalLM's "
                                          r"max_position_embeddings \(128\)"):
        _llm(path, max_model_len=MAX_POS + 1)
    llm = _llm(path)
    assert llm.engine.max_model_len == MAX_POS
    assert llm.engine.model.model.embed_positions.weight.shape == (MAX_POS + 2, 64)
    refused = llm.generate([[5] * MAX_POS], GREEDY, use_tqdm=False)[0]
    assert "prompt has 128 tokens but max_model_len is 128" in refused.error
    prompt = random_prompts(1, 120, 120, seed=2)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == MAX_POS
    assert out.token_ids == hf_greedy(path, [prompt], MAX_POS - len(prompt))[0]


# ----------------------------------------------------------------- loading, LoRA
@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    """Every tensor back under its HF name (q/k/v_proj split out of our qkv_proj), equal
    to the file's; the LoRA targets under OPT's names."""
    path = tiny(name)
    model, ref = load_and_round_trip(path)
    targets = model.lora_targets()
    assert targets["model.decoder.layers.1.self_attn.v_proj"] == (
        "model.layers.1.self_attn.qkv_proj", 128, 64)
    assert targets["model.decoder.layers.1.self_attn.out_proj"] == (
        "model.layers.1.self_attn.o_proj", 0, 64)
    assert targets["model.decoder.layers.0.fc1"] == ("model.layers.0.mlp.c_fc", 0, 128)
    assert targets["model.decoder.layers.0.fc2"] == ("model.layers.0.mlp.c_proj", 0, 64)
    assert len(targets) == 2 * 6


def test_hub_file_layout_loads(tiny, tmp_path):
    """The Hub's files (facebook/opt-*) name tensors as OPTModel does (``decoder.*``, no
    ``model.``) and may hold the tied lm_head: they load to the same weights."""
    path = tiny("opt_350m")

    def hub_names(t):
        for n in list(t):
            t[n.removeprefix("model.")] = t.pop(n)
        t["lm_head.weight"] = t["decoder.embed_tokens.weight"].clone()

    hub = edited_copy(path, tmp_path / "hub", edit=hub_names)
    assert "decoder.project_in.weight" in load_file(str(hub / "model.safetensors"))
    a, b = _load(path), _load(hub)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_lora_adapter_under_opt_names_gives_the_merged_checkpoints_tokens(tiny, tmp_path):
    """A PEFT adapter on q_proj, v_proj, out_proj, fc1 and fc2 (model.decoder.layers.N...)
    gives transformers' tokens of the checkpoint with it merged."""
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (64, 64),
              "self_attn.out_proj": (64, 64), "fc1": (64, 128), "fc2": (128, 64)}
    adapter = write_named_adapter(tmp_path / "adapter", {
        f"model.decoder.layers.{layer}.{module}": shape for layer in range(2)
        for module, shape in shapes.items()})
    assert_adapter_gives_merged_tokens(tiny("opt"), adapter, tmp_path)


@pytest.mark.parametrize(("name", "dropped"), [
    ("opt", "model.decoder.layers.1.fc2.bias"),
    ("opt", "model.decoder.layers.0.self_attn.k_proj.weight"),
    ("opt", "model.decoder.embed_positions.weight"),
    ("opt_350m", "model.decoder.project_in.weight"),
])
def test_missing_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path, name, dropped):
    assert_missing_tensor_named(tiny(name), tmp_path, dropped)


def test_bad_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path):
    def edit(t):
        t["model.decoder.embed_positions.weight"] = t["model.decoder.embed_positions.weight"][2:]

    path = edited_copy(tiny("opt"), tmp_path / "edited", edit=edit)
    with pytest.raises(ValueError, match=r"model\.decoder\.embed_positions\.weight: checkpoint "
                                         r"shape \(128, 64\) != \(130, 64\)"):
        _load(path)


def test_fp8_at_load_runs_the_dequantized_weights(tiny, tmp_path):
    """quantization="fp8" quantizes each layer's qkv_proj, o_proj, c_fc and c_proj, not
    project_in / project_out or the tied head; its weights given back under OPT's names
    (dequantized) are a checkpoint on which transformers gives our fp8 tokens."""
    from flashpage.layers.quant import quantized_linears

    path = tiny("opt_350m")
    llm = _llm(path, quantization="fp8")
    model = llm.engine.model
    assert sorted(quantized_linears(model)) == sorted(
        f"model.layers.{i}.{sub}" for i in range(2)
        for sub in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj"))
    weights = {n: w.contiguous() for n, w in model.hf_weights()}
    deq = edited_copy(path, tmp_path / "deq", edit=lambda t: t.update(weights))
    prompts = random_prompts(3, 5, 40, seed=4)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        deq, prompts, GREEDY.max_tokens)
    original = load_file(str(path / "model.safetensors"))
    assert not torch.equal(weights["model.decoder.layers.0.fc1.weight"],
                           original["model.decoder.layers.0.fc1.weight"])
    assert torch.equal(weights["model.decoder.project_in.weight"],
                       original["model.decoder.project_in.weight"])


# ----------------------------------------------------------------- inspect, config
@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


# config.json as published (facebook/opt-125m; facebook/opt-350m's differing fields)
OPT_125M = dict(_remove_final_layer_norm=False, activation_dropout=0.0,
                activation_function="relu", architectures=["OPTForCausalLM"],
                attention_dropout=0.0, bos_token_id=2, do_layer_norm_before=True, dropout=0.1,
                eos_token_id=2, ffn_dim=3072, hidden_size=768, init_std=0.02, layerdrop=0.0,
                max_position_embeddings=2048, model_type="opt", num_attention_heads=12,
                num_hidden_layers=12, pad_token_id=1, prefix="</s>", torch_dtype="float16",
                use_cache=True, vocab_size=50272, word_embed_proj_dim=768)
OPT_350M = {**OPT_125M, "do_layer_norm_before": False, "ffn_dim": 4096, "hidden_size": 1024,
            "num_attention_heads": 16, "num_hidden_layers": 24, "word_embed_proj_dim": 512}


@pytest.mark.parametrize(("raw", "params"), [(OPT_125M, 125_239_296), (OPT_350M, 331_196_416)],
                         ids=["opt-125m", "opt-350m"])
def test_inspect_counts_real_shapes(raw, params):
    """OPT-125m's and OPT-350m's parameters as transformers builds them (meta device;
    the head tied), and their KV bytes per token: MHA, 2 x hidden values a layer."""
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    ours = ModelConfig.from_hf(dict(raw))
    assert param_counts(ours) == (params, params) and hf.num_parameters() == params
    info = inspect_config(ours, 80 << 30, dtype="float16")
    assert info["attention_kind"] == "MHA" and info["head_dim"] == 64
    assert info["kv_bytes_per_token"] == 2 * raw["hidden_size"] * 2 * raw["num_hidden_layers"]
    assert info["kv_bytes_per_token"] == (36_864 if raw is OPT_125M else 98_304)
    assert info["position_rows"] == 2050 and info["rotary_dim"] is None
    assert info["nope_layers"] == 0


def test_inspect_reports_learned_positions(tmp_path, capsys):
    from flashpage.inspect import main

    (tmp_path / "config.json").write_text(json.dumps(OPT_125M))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "OPTForCausalLM (opt)" in out and "MHA" in out and "0.125 B" in out
    assert "learned (embed_positions, 2,050 rows: max_model_len at most 2,048), no rotary" in out
    assert "36,864 B" in out and "rotary " not in out


def _raw(name: str, **edit) -> dict:
    d = _hf_config(name).to_dict()
    d["architectures"] = ["OPTForCausalLM"]
    d.update(edit)
    return d


def test_config_fields():
    c = ModelConfig.from_hf(dict(OPT_125M))
    assert (c.architecture, c.hidden_size, c.intermediate_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.max_position_embeddings, c.hidden_act,
            c.rms_norm_eps, c.position_offset, c.word_embed_proj_dim) == (
        "OPTForCausalLM", 768, 3072, 12, 12, 64, 2048, "relu", 1e-5, 2, 768)
    assert c.learned_positions and not c.uses_rope(0) and c.tie_word_embeddings
    assert c.attention_bias and c.mlp_bias and c.do_layer_norm_before and c.final_norm
    assert c.norm_elementwise_affine and c.quantization_config is None
    s = ModelConfig.from_hf(dict(OPT_350M))
    assert (s.do_layer_norm_before, s.final_norm, s.word_embed_proj_dim) == (False, False, 512)
    b = ModelConfig.from_hf(_raw("opt_bare"))
    assert (b.final_norm, b.norm_elementwise_affine, b.attention_bias, b.mlp_bias,
            b.hidden_act, b.tie_word_embeddings) == (False, False, False, False, "gelu", False)
    # OPTConfig's defaults where config.json says nothing: model_type alone
    bare = ModelConfig.from_hf({k: v for k, v in OPT_125M.items() if k not in (
        "architectures", "ffn_dim", "activation_function", "do_layer_norm_before",
        "word_embed_proj_dim", "_remove_final_layer_norm", "max_position_embeddings")})
    assert (bare.architecture, bare.intermediate_size, bare.hidden_act, bare.final_norm,
            bare.word_embed_proj_dim, bare.max_position_embeddings) == (
        "OPTForCausalLM", 3072, "relu", True, 768, 2048)


@pytest.mark.parametrize(("edit", "message"), [
    (dict(ffn_dim=0), "ffn_dim must be a positive integer, got 0"),
    (dict(ffn_dim=None), "ffn_dim must be a positive integer, got None"),
    (dict(word_embed_proj_dim=-1),
     r"word_embed_proj_dim must be a positive integer or null \(hidden_size\), got -1"),
    (dict(activation_function="relu6"),
     r"activation_function 'relu6' is not supported for OPTForCausalLM \(supported: "
     r"gelu_pytorch_tanh, gelu, gelu_new, gelu_fast, relu, relu2\)"),
    (dict(do_layer_norm_before="false"), "do_layer_norm_before must be true or false"),
    (dict(_remove_final_layer_norm=1), "_remove_final_layer_norm must be true or false, got 1"),
    (dict(enable_bias="yes"), "enable_bias must be true or false, got 'yes'"),
    (dict(layer_norm_elementwise_affine=0),
     "layer_norm_elementwise_affine must be true or false, got 0"),
    (dict(tie_word_embeddings="true"), "tie_word_embeddings must be true or false"),
    (dict(hidden_size=770), r"hidden_size \(770\) must be num_attention_heads \(12\) x head_dim"),
    (dict(num_key_value_heads=4), "num_key_value_heads 4 is not read for OPTForCausalLM"),
])
def test_bad_config_is_a_clear_error(edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**OPT_125M, **edit})


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a Triton attention tile unpadded (opt_350m's embeddings
    64 wide, half the hidden size); max_position_embeddings past the longest run."""
    extra = dict(word_embed_proj_dim=64) if "word_embed_proj_dim" in TINY[name] else {}
    return build_tiny(tmp_path / name, name, hidden_size=128, num_attention_heads=2,
                      ffn_dim=256, max_position_embeddings=256, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention kernels without rotary, eager and in CUDA graphs (positions an input
    the graphs replay from, + 2 inside them), against transformers' fp32 tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    assert llm.engine.model.attention_layers()[0].kv_cache[0].shape[2] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 (triton, graphs) against transformers' fp32 tokens, teacher-forced: ours picks
    fp32's token as often as transformers' own bf16 does (conftest's
    bf16_teacher_forced_hits)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton")
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total and ours16 >= 0.85 * total, (ours16, hf16, total)
