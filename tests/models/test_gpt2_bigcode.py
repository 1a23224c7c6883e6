"""GPT-2 (GPT2LMHeadModel: Conv1D weights, gelu_new) and GPT-BigCode (StarCoder 1 /
SantaCoder: nn.Linear weights, multi-query attention, or per-head c_attn rows without it):
learned absolute positions, no rotary (models/gpt2.py).

CPU, fp32: greedy tokens and prompt logprobs equal transformers' for each (and on our
Triton kernels in the interpreter); chunked prefill, preemption and prefix hits (the
positions of every chunk); generation ends at n_positions
and a max_model_len past it is refused; MQA caches one KV head; weights back under HF's
names and layouts; the Hub's GPT-2 file layout (no ``transformer.`` prefix, mask buffers)
loads; a LoRA adapter (on GPT-2's Conv1D linears too) gives the merged model's tokens;
``flashpage inspect``'s parameter counts (GPT-2 small, StarCoder too); config fields and
errors.
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens,
and bf16 follows fp32 about as far as transformers' bf16 does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from flashpage import LLM, LoRARequest, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import inspect_config, param_counts
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    assert_dense_params_match_hf,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    cpu_llm,
    edited_copy,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    save_widened,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
N_POSITIONS = 128

# name -> (HF config class name, extra config kwargs); 2 layers, n_embd 64, 4 heads
TINY: dict[str, tuple[str, dict]] = {
    # GPT-2's shape: gelu_new, tied head, 4 * n_embd MLP
    "gpt2": ("GPT2Config", {}),
    # the attention scaled by 1 / (layer + 1) too, exact GELU, n_inner, an untied head
    "gpt2_scaled": ("GPT2Config", dict(scale_attn_by_inverse_layer_idx=True,
                                       activation_function="gelu", n_inner=96,
                                       layer_norm_epsilon=1e-3, tie_word_embeddings=False)),
    # StarCoder's / SantaCoder's: multi-query (one KV head), gelu_pytorch_tanh, tied
    "bigcode_mqa": ("GPTBigCodeConfig", {}),
    # multi_query false: c_attn's rows head by head; q.k unscaled, n_inner, untied
    "bigcode_mha": ("GPTBigCodeConfig", dict(multi_query=False, scale_attn_weights=False,
                                             n_inner=96, tie_word_embeddings=False)),
}
NAMES = sorted(TINY)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ARCH = {"GPT2Config": "GPT2LMHeadModel", "GPTBigCodeConfig": "GPTBigCodeForCausalLM"}


def _hf_config(name: str, **overrides):
    cls_name, extra = TINY[name]
    base = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=N_POSITIONS,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return getattr(transformers, cls_name)(**{**base, **extra, **overrides})


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint, weights widened as conftest's builders do (far from ties)."""
    return save_widened(_hf_config(name, **overrides), path, seed, lambda n: ".ln_" in n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    prompts = random_prompts(3, 5, 60, seed=1)
    llm = cpu_llm(path)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        path, prompts, GREEDY.max_tokens)
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves: each prompt token's logprob is transformers' log-softmax."""
    path = tiny(name)
    prompt = random_prompts(1, 60, 60, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = cpu_llm(path).generate([prompt], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    want = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "bigcode_mqa"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: each chunk, recomputed prompt and cached prefix must add wpe's rows for its
    own positions to give transformers' tokens."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


@pytest.mark.parametrize("name", ["gpt2", "bigcode_mqa"])
def test_greedy_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend (our prefill and paged decode attention with no rotary, MQA's
    one KV head; on the CPU in the interpreter, a few seconds each)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(2, 20, 34, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    assert llm.engine.backend_name == "triton"
    got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == hf_greedy(path, prompts, params.max_tokens)


def test_generation_ends_at_n_positions(tiny):
    """wpe has n_positions rows: max_model_len defaults to it, a larger one is a
    ConfigError naming n_positions, a prompt of n_positions tokens is refused, and a run
    stops (finish_reason "length") at n_positions tokens with transformers' tokens."""
    path = tiny("gpt2")
    with pytest.raises(ConfigError, match=r"max_model_len 129 is past GPT2LMHeadModel's "
                                          r"n_positions \(128\)"):
        cpu_llm(path, max_model_len=N_POSITIONS + 1)
    llm = cpu_llm(path)
    assert llm.engine.max_model_len == N_POSITIONS
    refused = llm.generate([[5] * N_POSITIONS], GREEDY, use_tqdm=False)[0]
    assert "prompt has 128 tokens but max_model_len is 128" in refused.error
    prompt = random_prompts(1, 120, 120, seed=2)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == N_POSITIONS
    assert out.token_ids == hf_greedy(path, [prompt], N_POSITIONS - len(prompt))[0]
    shorter = cpu_llm(path, max_model_len=64)  # below n_positions: fine
    assert shorter.engine.max_model_len == 64


@pytest.mark.parametrize(("name", "kv_heads"), [("bigcode_mqa", 1), ("bigcode_mha", 4)])
def test_multi_query_caches_one_kv_head(tiny, name, kv_heads):
    """multi_query: one K and one V head per layer in the paged cache (and in the bytes
    per token the cache is sized by, and in inspect's figures)."""
    llm = cpu_llm(tiny(name))
    for layer in llm.engine.model.attention_layers():
        k, v = layer.kv_cache
        assert k.shape[2:] == v.shape[2:] == (kv_heads, 16)
    cfg = llm.engine.model_config
    assert cfg.num_key_value_heads == kv_heads
    assert cfg.kv_bytes_per_token("float32") == 2 * 2 * kv_heads * 16 * 4
    info = inspect_config(cfg, 1 << 30)
    assert info["attention_kind"] == ("MQA" if kv_heads == 1 else "MHA")
    assert info["cached_kv_heads"] == kv_heads and info["kv_reduction_vs_mha"] == 4 / kv_heads


# ----------------------------------------------------------------- loading, LoRA
@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    """Every tensor back under its HF name, in its HF layout (GPT-2's Conv1D [in, out],
    BigCode's per-head c_attn rows), equal to the file's."""
    path = tiny(name)
    model, ref = load_and_round_trip(path)
    c_attn = model.transformer.h[0].attn.c_attn.weight
    rows = 64 + 2 * 16 * (1 if name == "bigcode_mqa" else 4)
    assert c_attn.shape == (rows, 64)
    if name.startswith("gpt2"):  # Conv1D: the file holds it [in, out]
        assert ref["transformer.h.0.attn.c_attn.weight"].shape == (64, rows)
    if name == "bigcode_mha":  # regrouped: head 0's k rows follow its q rows in the file
        file_rows = ref["transformer.h.0.attn.c_attn.weight"]
        assert torch.equal(c_attn[64:80], file_rows[16:32])
    targets = model.lora_targets()
    assert targets["transformer.h.1.mlp.c_fc"] == ("transformer.h.1.mlp.c_fc", 0,
                                                   96 if name.endswith(("scaled", "mha")) else 256)
    assert targets["transformer.h.0.attn.c_attn"] == ("transformer.h.0.attn.c_attn", 0, rows)


def test_hub_gpt2_file_layout_loads(tiny, tmp_path):
    """The Hub's GPT-2 files name tensors as GPT2Model does (no ``transformer.``) and hold
    each layer's causal-mask buffers: they load to the same weights."""
    path = tiny("gpt2")

    def hub_names(t):
        for n in list(t):
            t[n.removeprefix("transformer.")] = t.pop(n)
        for i in range(2):
            t[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, N_POSITIONS, N_POSITIONS))
            t[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)

    hub = edited_copy(path, tmp_path / "hub", edit=hub_names)
    assert "h.0.attn.c_attn.weight" in load_file(str(hub / "model.safetensors"))
    a, b = (load_model(resolve_model(str(p)), torch.float32, torch.device("cpu"))
            for p in (path, hub))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_conv1d_weight_in_the_wrong_layout_is_named(tiny, tmp_path):
    """A GPT-2 file whose c_fc weight is stored [out, in] (nn.Linear's) is refused, naming
    the tensor and the layout it should have."""

    def transpose(t):
        t["transformer.h.1.mlp.c_fc.weight"] = t["transformer.h.1.mlp.c_fc.weight"].t().contiguous()

    bad = edited_copy(tiny("gpt2"), tmp_path / "bad", edit=transpose)
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight: checkpoint "
                                         r"shape \(256, 64\) != \(64, 256\) \(a Conv1D weight, "
                                         r"stored \[in, out\]\)"):
        load_model(resolve_model(str(bad)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", ["gpt2_scaled", "bigcode_mqa", "bigcode_mha"])
def test_lora_gives_the_merged_models_tokens(tiny, tmp_path, name):
    """A PEFT adapter on c_attn, attn.c_proj, c_fc and mlp.c_proj (GPT-2's Conv1D ones with
    fan_in_fan_out, as PEFT writes them; BigCode MHA's per-head c_attn, its lora_B rows
    regrouped as the weight's): ours with the adapter = transformers on the merged
    checkpoint, W + scaling * B @ A (Conv1D's [in, out]: its transpose), computed from the
    files alone."""
    path = tiny(name)
    conv1d = name.startswith("gpt2")
    # MQA: q (64) + one k and v head (16); MHA: 3 x 64
    inter, qkv = (256, 96) if name == "bigcode_mqa" else (96, 192)
    shapes = {"attn.c_attn": (64, qkv), "attn.c_proj": (64, 64), "mlp.c_fc": (64, inter),
              "mlp.c_proj": (inter, 64)}
    r, alpha = 4, 8
    g = torch.Generator().manual_seed(0)
    adapter, merged = tmp_path / "adapter", load_file(str(path / "model.safetensors"))
    adapter.mkdir()
    tensors = {}
    for i in range(2):
        for sub, (fin, fout) in shapes.items():
            a, b = torch.randn(r, fin, generator=g) * 0.15, torch.randn(fout, r, generator=g) * 0.15
            key = f"base_model.model.transformer.h.{i}.{sub}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            delta = (alpha / r) * b @ a
            merged[f"transformer.h.{i}.{sub}.weight"] += delta.t() if conv1d else delta
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
        "target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": conv1d,
        "lora_dropout": 0.0, "bias": "none"}))
    merged_path = edited_copy(path, tmp_path / "merged", edit=lambda t: t.update(merged))
    prompts = random_prompts(3, 5, 40, seed=3)
    llm = cpu_llm(path, enable_lora=True, max_lora_rank=8)
    got = _tokens(llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)),
                               use_tqdm=False))
    want = hf_greedy(merged_path, prompts, GREEDY.max_tokens)
    assert got == want and want != hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("name", ["gpt2", "bigcode_mha"])
def test_fp8_at_load_runs_the_dequantized_weights(tiny, tmp_path, name):
    """quantization="fp8" quantizes the four linears of each block (not the tied head);
    its weights given back under HF's layouts (dequantized, Conv1D transposed, BigCode's
    c_attn rows per head) are a checkpoint on which transformers gives our fp8 tokens."""
    from flashpage.layers.quant import quantized_linears

    path = tiny(name)
    llm = cpu_llm(path, quantization="fp8")
    model = llm.engine.model
    assert sorted(quantized_linears(model)) == sorted(
        f"transformer.h.{i}.{sub}" for i in range(2)
        for sub in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    weights = {n: w.contiguous() for n, w in model.hf_weights()}
    deq = edited_copy(path, tmp_path / "deq", edit=lambda t: t.update(weights))
    prompts = random_prompts(3, 5, 40, seed=4)
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(deq, prompts, GREEDY.max_tokens)
    assert not torch.equal(weights["transformer.h.0.mlp.c_fc.weight"],
                           load_file(str(path / "model.safetensors"))["transformer.h.0.mlp.c_fc.weight"])


# ----------------------------------------------------------------- inspect, config
@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


def test_inspect_known_models():
    """GPT-2 small (124,439,808 parameters, transformers' count) and StarCoder (15.5B; MQA:
    one 128-dim K and V per layer, 40 layers, 20 KiB a token in bf16), from their configs."""
    gpt2 = ModelConfig.from_hf(dict(architectures=["GPT2LMHeadModel"], vocab_size=50257,
                                    n_embd=768, n_layer=12, n_head=12, n_positions=1024))
    assert param_counts(gpt2) == (124_439_808, 124_439_808)
    starcoder = ModelConfig.from_hf(dict(
        architectures=["GPTBigCodeForCausalLM"], vocab_size=49152, n_embd=6144, n_layer=40,
        n_head=48, n_inner=24576, n_positions=8192, multi_query=True))
    info = inspect_config(starcoder, 80 << 30)
    assert info["param_count"] == 15_517_456_384
    assert info["kv_bytes_per_token"] == 40 * 2 * 128 * 2 and info["attention_kind"] == "MQA"


def test_inspect_reports_learned_positions(tiny, capsys):
    from flashpage.inspect import main

    assert main([str(tiny("bigcode_mqa"))]) == 0
    out = capsys.readouterr().out
    assert "GPTBigCodeForCausalLM (gpt_bigcode)" in out and "MQA" in out
    assert "learned (wpe, 128 rows: max_model_len at most 128), no rotary" in out
    assert "rotary " not in out


def _raw(name: str, **edit) -> dict:
    d = _hf_config(name).to_dict()
    d["architectures"] = [ARCH[TINY[name][0]]]
    d.update(edit)
    return d


def test_config_fields():
    g = ModelConfig.from_hf(_raw("gpt2"))
    assert (g.architecture, g.hidden_size, g.num_hidden_layers, g.num_attention_heads,
            g.num_key_value_heads, g.head_dim, g.intermediate_size, g.max_position_embeddings,
            g.hidden_act, g.rms_norm_eps) == ("GPT2LMHeadModel", 64, 2, 4, 4, 16, 256, 128,
                                              "gelu_new", 1e-5)
    assert g.learned_positions and g.tie_word_embeddings and g.attention_bias and g.mlp_bias
    assert g.scale_attn_weights and not g.scale_attn_by_inverse_layer_idx
    s = ModelConfig.from_hf(_raw("gpt2_scaled"))
    assert (s.intermediate_size, s.hidden_act, s.rms_norm_eps, s.tie_word_embeddings,
            s.scale_attn_by_inverse_layer_idx) == (96, "gelu", 1e-3, False, True)
    m = ModelConfig.from_hf(_raw("bigcode_mqa"))
    assert (m.architecture, m.num_key_value_heads, m.attention_kind, m.hidden_act) == (
        "GPTBigCodeForCausalLM", 1, "MQA", "gelu_pytorch_tanh")
    h = ModelConfig.from_hf(_raw("bigcode_mha"))
    assert (h.num_key_value_heads, h.scale_attn_weights) == (4, False)
    # the configs' defaults where config.json says nothing: model_type alone, no n_positions
    # (1024), no multi_query (true), no activation (gelu_new / gelu_pytorch_tanh), tied
    drop = ("architectures", "n_positions", "multi_query", "activation_function",
            "tie_word_embeddings", "n_inner")
    for name, arch, kv, act in (("gpt2", "GPT2LMHeadModel", 4, "gelu_new"),
                                ("bigcode_mqa", "GPTBigCodeForCausalLM", 1, "gelu_pytorch_tanh")):
        c = ModelConfig.from_hf({k: v for k, v in _raw(name).items() if k not in drop})
        assert (c.architecture, c.max_position_embeddings, c.num_key_value_heads, c.hidden_act,
                c.tie_word_embeddings, c.intermediate_size) == (arch, 1024, kv, act, True, 256)


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("gpt2", dict(n_embd=None), "n_embd must be a positive integer, got None"),
    ("gpt2", dict(n_head=0), "n_head must be a positive integer, got 0"),
    ("gpt2", dict(n_layer="2"), "n_layer must be a positive integer, got '2'"),
    ("gpt2", dict(n_positions=-1), "n_positions must be a positive integer, got -1"),
    ("gpt2", dict(n_head=5), r"n_embd \(64\) is not a multiple of n_head \(5\)"),
    ("gpt2", dict(n_inner=0), r"n_inner must be a positive integer or null \(4 \* n_embd\)"),
    ("gpt2", dict(activation_function="relu6"),
     r"activation_function 'relu6' is not supported for GPT2LMHeadModel \(supported: "
     r"gelu_pytorch_tanh, gelu, gelu_new, gelu_fast, relu, relu2\)"),
    ("gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn true is not supported"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention true is not supported"),
    ("gpt2", dict(scale_attn_weights="yes"), "scale_attn_weights must be true or false"),
    ("gpt2", dict(layer_norm_epsilon=0), "layer_norm_epsilon must be a positive number, got 0"),
    ("gpt2", dict(quantization_config={"quant_method": "fp8"}),
     "quantization_config .* is not read for GPT2LMHeadModel"),
    ("bigcode_mqa", dict(multi_query="true"), "multi_query must be true or false, got 'true'"),
    ("bigcode_mqa", dict(activation_function="quick_gelu"),
     "activation_function 'quick_gelu' is not supported for GPTBigCodeForCausalLM"),
    ("bigcode_mqa", dict(tie_word_embeddings=1), "tie_word_embeddings must be true or false"),
])
def test_bad_config_is_a_clear_error(name, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(name, **edit))


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a Triton attention tile unpadded; n_positions past the
    longest run (120-token prompts + 18 tokens)."""
    extra = dict(n_inner=192) if "n_inner" in TINY[name][1] else {}
    return build_tiny(tmp_path / name, name, n_embd=128, n_head=2, n_positions=256, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention kernels without rotary (MQA: one KV head), eager and in CUDA graphs
    (positions an input the graphs replay from), against transformers' fp32 tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    assert llm.engine.model.attention_layers()[0].kv_cache[0].shape[2] == (
        1 if name == "bigcode_mqa" else 2)


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
