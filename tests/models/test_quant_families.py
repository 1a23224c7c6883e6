"""AWQ / GPTQ (int4) and fp8 checkpoints of the families beyond Llama / Qwen / Mistral:
Phi-3 (its checkpoints' merged qkv_proj / gate_up_proj quantized as one linear each),
Gemma 1/2/3, Granite, OLMo / OLMo2, Cohere / Cohere2, StarCoder2 (non-gated c_fc /
c_proj), and GPT-NeoX / Phi-2, GPT-J, Falcon and OPT, whose checkpoint names reach our
linears through their ``hf_names`` (NeoX's and Falcon's query_key_value rows, with their
scales and zero points, regrouped head by head or per KV group at load; OPT-350m's
project_in / project_out, quantized by the file, dequantized: they stay 16-bit).

Each checkpoint is a tiny random model of the family quantized by the builders of
test_int4_checkpoints.py / test_fp8_checkpoints.py (our group quantizer written in AWQ's
or GPTQ's packing; per-channel, per-tensor or block-scaled e4m3), with its reference twin
holding the same weights dequantized in fp32. Checked, fp32 on the CPU: which of our
linears keep int4 / e4m3, every weight read back under the family's names equal to the
twin's to the bit, and the engine's greedy tokens equal to transformers' over the twin.
On the GPU (marked gpu): bf16 with CUDA graphs and our kernels against the bf16 engine
over the twin, as test_int4_checkpoints / test_fp8_checkpoints do for Llama."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.int4 import int4_linears
from flashpage.layers.quant import quantized_linears
from tests.conftest import _checkpoints, _save_tiny_routed, hf_greedy, random_prompts
from tests.models.test_fp8_checkpoints import FORMATS as FP8_FORMATS
from tests.models.test_fp8_checkpoints import build_fp8_checkpoint
from tests.models.test_gemma import EAGER, build_tiny_gemma
from tests.models.test_gptj_falcon import build_tiny as build_tiny_gptj_falcon
from tests.models.test_int4_checkpoints import build_int4_checkpoint
from tests.models.test_opt import build_tiny as build_tiny_opt

GPU = torch.cuda.is_available()
L2 = dict(num_hidden_layers=2)

# name -> (HF config class, fields), as the families' own tests build them (2 layers,
# hidden 64, 4 heads of 16); Gemma's come from test_gemma's builder (3 layers)
FAMILIES: dict[str, tuple[str, dict]] = {
    "phi3": ("Phi3Config", dict(L2, num_key_value_heads=2, sliding_window=24,
                                partial_rotary_factor=0.5)),
    "granite": ("GraniteConfig", dict(L2, num_key_value_heads=2, embedding_multiplier=12.0,
                                      residual_multiplier=0.22, attention_multiplier=0.09,
                                      logits_scaling=8.0, attention_bias=True)),
    "olmo": ("OlmoConfig", dict(L2, num_key_value_heads=2, clip_qkv=1.0, tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", dict(L2, num_key_value_heads=2)),
    "cohere": ("CohereConfig", dict(L2, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.8,
                                    attention_bias=True, tie_word_embeddings=True)),
    "cohere2": ("Cohere2Config", dict(L2, num_key_value_heads=2, sliding_window=16,
                                      layer_types=["sliding_attention", "full_attention"],
                                      logit_scale=0.25)),
    "starcoder2": ("Starcoder2Config", dict(L2, num_key_value_heads=2, sliding_window=16,
                                            tie_word_embeddings=True)),
    "neox": ("GPTNeoXConfig", dict(L2, rotary_pct=0.25, layer_norm_eps=1e-4)),
    "phi": ("PhiConfig", dict(L2)),
    "gemma": ("gemma", {}), "gemma2": ("gemma2", {}), "gemma3": ("gemma3", {}),
    # test_gptj_falcon's and test_opt's builders: GPT-J-6B's form; Falcon-40B's (2 KV groups
    # of 2 query heads, biases) and Falcon-7B's (MQA: one group, not regrouped); OPT-350m's
    # (post-LN, project_in / project_out around the layers)
    "gptj": ("gptj", {}), "falcon_40b": ("falcon_40b", {}), "falcon_7b": ("falcon_7b", {}),
    "opt_350m": ("opt_350m", {}),
}
# heads of 64 for the GPU tests, in each own builder's config names
HEAD64 = {"gptj": dict(n_embd=128, n_head=2), "opt_350m": dict(hidden_size=128,
                                                                num_attention_heads=2)}
# transformers' eager attention for the softcaps
HF_KWARGS = {"gemma2": EAGER, "gemma3": EAGER}

# NeoX's query_key_value regrouped head by head: its block scales with blocks of whole heads
FP8_BLOCK16 = dict(config={"quant_method": "fp8", "activation_scheme": "dynamic",
                           "weight_block_size": [16, 16]},
                   strategy="block", block=(16, 16), scale_name="weight_scale_inv")
# family -> (int4 format, fp8 format) of test_int4_checkpoints / test_fp8_checkpoints.FORMATS:
# each format on several families. awq_g32 leaves layer 1's v_proj 16-bit (its merged qkv
# dequantized), ct_channel layer 1's down_proj, fp8_tensor_static layer 1's q_proj
CASES = {
    "phi3": ("awq_g32", "fp8_block"), "granite": ("gptq_g32", "ct_channel"),
    "olmo": ("awq_g32", "fp8_tensor_static"), "olmo2": ("gptq_row_sym", "fp8_block"),
    "cohere": ("gptq_g32", "fp8_block"), "cohere2": ("awq_g32", "ct_channel"),
    "starcoder2": ("gptq_g32", "fp8_tensor_static"), "neox": ("awq_g32", "fp8_block16"),
    "phi": ("gptq_g32", "fp8_tensor_static"), "gemma": ("awq_g32", "ct_channel"),
    "gemma2": ("gptq_g32", "fp8_block"), "gemma3": ("gptq_row_sym", "fp8_tensor_static"),
    "gptj": ("gptq_g32", "ct_channel"), "falcon_40b": ("awq_g32", "fp8_block16"),
    "falcon_7b": ("gptq_row_sym", "fp8_block"), "opt_350m": ("gptq_g32", "fp8_tensor_static"),
}
NAMES = sorted(CASES)
# fp8 checkpoints whose tokens are run too (the others: kept linears and weights only, as
# the e4m3 linears' forward is the same in every family): the merged-on-disk, regrouped
# (per head, per KV group, and MQA's one group under 32-row blocks that span heads),
# non-gated, fp8-embedding, softcapped and projected (OPT-350m) cases
FP8_TOKENS = {"phi3", "neox", "starcoder2", "gemma2", "gemma3", "cohere", "falcon_40b",
              "falcon_7b", "opt_350m"}


def is_linear(name: str, w: torch.Tensor) -> bool:
    """A linear's weight in any of these families' checkpoints: 2-D, not an embedding, a
    norm (Cohere's per-head q/k norms are 2-D) or the LM head (GPT-J's embeddings: wte)."""
    return (name.endswith(".weight") and w.dim() == 2 and "norm" not in name
            and not any(k in name for k in ("embed", "wte", "lm_head")))


def build_family(path: Path, name: str, seed: int = 0, head64: bool = False) -> Path:
    """``head64``: heads of 64, the smallest our Triton attention kernels take (the GPU
    tests; hidden 128 where the heads divide it)."""
    cls_name, extra = FAMILIES[name]
    if name.startswith("gemma"):
        return build_tiny_gemma(path, name, seed, **(dict(head_dim=64) if head64 else {}))
    if name in ("gptj", "falcon_40b", "falcon_7b", "opt_350m"):
        build = build_tiny_opt if name.startswith("opt") else build_tiny_gptj_falcon
        return build(path, name, seed, **(HEAD64.get(name, dict(hidden_size=128,
                                                                num_attention_heads=2))
                                          if head64 else {}))
    if head64:
        extra = dict(extra, hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    return _save_tiny_routed(path, cls_name, extra, seed, False)


@pytest.fixture(scope="module")
def quant_checkpoint(tmp_path_factory):
    """(family, format, head64=False) -> (quantized folder, dequantized twin, {weight:
    stored as}), built once."""
    sources = {h: _checkpoints(tmp_path_factory, lambda p, n, h=h: build_family(p, n, head64=h))
               for h in (False, True)}
    cache: dict[tuple[str, str, bool], tuple[Path, Path, dict]] = {}

    def get(family: str, fmt: str, head64: bool = False):
        if (family, fmt, head64) not in cache:
            src = sources[head64](family)
            root = tmp_path_factory.mktemp(f"{family}_{fmt}")
            if fmt in FP8_FORMATS or fmt == "fp8_block16":
                stored = build_fp8_checkpoint(src, root / "q", root / "ref",
                                              FP8_FORMATS.get(fmt, FP8_BLOCK16), is_linear)
            else:
                stored = build_int4_checkpoint(src, root / "q", root / "ref", fmt, is_linear)
            cache[family, fmt, head64] = (root / "q", root / "ref", stored)
        return cache[family, fmt, head64]

    return get


def _expected_kept(model, stored: dict) -> list[str]:
    """Our linears all of whose checkpoint pieces the file quantized (the ones that keep
    int4 / e4m3): each piece's module under our names, merged q/k/v and gate/up included;
    a block-scaled NeoX query_key_value whose heads split a block is not, nor OPT's
    project_in / project_out (16-bit whatever the file holds)."""
    from flashpage.models.fp8_checkpoint import linear_of

    pieces: dict[str, list[bool]] = {}
    for name, how in stored.items():
        mod = name.removesuffix(".weight")
        if mod in ("lm_head", "embed_out") or "embed" in mod or "wte" in mod:
            continue  # a quantized LM head or embedding is dequantized
        hit = linear_of(model, mod)
        assert hit is not None, mod
        if hit[0] in ("model.project_in", "model.project_out"):
            assert not hit[1].quantizable
            continue
        pieces.setdefault(hit[0], []).append(how != "16-bit")
    return sorted(p for p, q in pieces.items() if all(q))


def _generate(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    from flashpage import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8,
              attention_backend="torch_native")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    model = llm.engine.model
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs], model


def _check_weights_and_inspect(model, path: Path, ref: Path) -> None:
    """Every linear weight read back under the checkpoint's names is the twin's to the bit;
    ``flashpage inspect`` counts the bytes the model holds (int4 / e4m3 linears and
    their scales, from the config alone)."""
    from flashpage.bench.common import weight_bytes
    from flashpage.inspect import inspect_config

    info = inspect_config(ModelConfig.from_hf(path), 1 << 30, "fp32")
    assert info["weights_bytes"] == weight_bytes(model)
    got = dict(model.hf_weights())
    for name, w in load_file(str(ref / "model.safetensors")).items():
        if is_linear(name, w):
            assert torch.equal(got[name], w), name


@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("family", NAMES)
def test_quantized_checkpoint_keeps_its_weights_and_gives_transformers_tokens(
        quant_checkpoint, family, kind):
    """LLM(checkpoint) with no flag, fp32: the linears all of whose pieces the file
    quantized hold them (int4 or e4m3, with their scales), the rest 16-bit; each weight
    read back under the family's checkpoint names is the twin's to the bit; greedy tokens
    equal transformers' over the twin (every int4 case, the FP8_TOKENS fp8 ones)."""
    fmt = CASES[family][0 if kind == "int4" else 1]
    path, ref, stored = quant_checkpoint(family, fmt)
    prompts = random_prompts(2, 4, 12, seed=5)
    run = kind == "int4" or family in FP8_TOKENS
    if run:
        tokens, model = _generate(path, prompts)
    else:
        from flashpage.models.loader import load_model, resolve_model

        model = load_model(resolve_model(str(path), None), torch.float32, torch.device("cpu"))
    if kind == "int4":
        stored = {f"{m}.weight": "int4" for m in stored} | {
            n: "16-bit" for n, w in load_file(str(ref / "model.safetensors")).items()
            if is_linear(n, w) and n.removesuffix(".weight") not in stored}
        kept = int4_linears(model)
    else:
        kept = quantized_linears(model)
    want = _expected_kept(model, stored)
    assert sorted(kept) == want and len(want) >= 3 * model.config.num_hidden_layers
    _check_weights_and_inspect(model, path, ref)
    if run:
        assert tokens == hf_greedy(ref, prompts, 6, **HF_KWARGS.get(family, {}))


@pytest.mark.parametrize("family", ["neox", "falcon_40b"])
def test_block_scales_that_split_a_head_are_dequantized(quant_checkpoint, family):
    """32-row blocks over 16-row heads: NeoX's query_key_value (regrouped head by head at
    load) and Falcon-40B's (per KV group) cannot keep their tiles' scales, so it is
    dequantized (its weight the file's values all the same); dense and the MLP keep e4m3
    with their block scales."""
    from flashpage.models.loader import load_model, resolve_model

    path, ref, _ = quant_checkpoint(family, "fp8_block")
    model = load_model(resolve_model(str(path), None), torch.float32, torch.device("cpu"))
    assert quantized_linears(model) == [f"model.layers.{i}.{m}" for i in range(2) for m in
                                        ("self_attn.o_proj", "mlp.c_fc", "mlp.c_proj")]
    assert model.model.layers[0].mlp.c_fc.weight_block == (32, 48)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    _check_weights_and_inspect(model, path, ref)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_opt_hub_layout_keeps_its_quantized_linears(quant_checkpoint, tmp_path, kind):
    """OPT files named as OPTModel names them (``decoder.*``, facebook/opt-*'s layout):
    the same linears keep int4 / e4m3 as under ``model.decoder.*``, to the same weights."""
    from flashpage.models.loader import load_model, resolve_model
    from tests.conftest import edited_copy

    path, _, _ = quant_checkpoint("opt_350m", CASES["opt_350m"][0 if kind == "int4" else 1])

    def hub_names(t):
        for n in list(t):
            t[n.removeprefix("model.")] = t.pop(n)

    hub = edited_copy(path, tmp_path / "hub", edit=hub_names)
    assert not any(n.startswith("model.") for n in load_file(str(hub / "model.safetensors")))
    held = int4_linears if kind == "int4" else quantized_linears
    a, b = (load_model(resolve_model(str(p), None), torch.float32, torch.device("cpu"))
            for p in (path, hub))
    assert held(b) == held(a) and len(held(a)) == 8
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_gpt2_checkpoints_still_refuse_quantization_config():
    """GPT-2 / BigCode keep the ConfigError: their Conv1D (GPT-2: [in, out]) and per-head
    c_attn weights have no reader; OLMoE's, Granite MoE's and DeepSeek's int4 checkpoints too
    (Mixtral's and Qwen-MoE's are read: tests/models/test_int4_moe_experts.py)."""
    base = {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4}
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    with pytest.raises(ConfigError, match=r"quantization_config \(a pre-quantized checkpoint\) "
                                          r"is not read for GPT2LMHeadModel"):
        ModelConfig.from_hf({**base, "architectures": ["GPT2LMHeadModel"],
                             "quantization_config": gptq})
    moe = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 4,
           "num_experts": 4, "num_experts_per_tok": 2, "quantization_config": gptq}
    with pytest.raises(ConfigError, match=r"gptq \(int4\) checkpoints are read for .* not "
                                          r"OlmoeForCausalLM"):
        ModelConfig.from_hf({**moe, "architectures": ["OlmoeForCausalLM"]})
    assert ModelConfig.from_hf({**moe, "architectures": ["MixtralForCausalLM"]}
                               ).quantization_config.is_int4


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("family", NAMES)
def test_quantized_family_bf16_on_the_gpu_with_graphs(quant_checkpoint, family, kind):
    """bf16 on CUDA, heads of 64, engine defaults (our Triton attention, CUDA graphs; the
    int4 GEMV / fp8 kernels) against the bf16 engine over the dequantized twin: each engine's greedy tokens, fed to the other
    as a prompt, are the other's top token wherever the first was sure (a top-2 margin
    above 1 nat)."""
    from flashpage import LLM, SamplingParams

    path, ref, _ = quant_checkpoint(family, CASES[family][0 if kind == "int4" else 1], True)
    prompts = random_prompts(8, 3, 120, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    forced = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def sure_and_full(outs):
        margins = torch.tensor([lp.top[0][1] - lp.top[1][1] for o in outs
                                for lp in o.outputs[0].logprobs])
        return margins > 1.0, [p + o.outputs[0].token_ids
                               for p, o in zip(prompts, outs, strict=True)]

    def ranks(llm, full):
        outs = llm.generate(full, forced, use_tqdm=False)
        return torch.tensor([e.rank for p, o in zip(prompts, outs, strict=True)
                             for e in o.prompt_logprobs[len(p):]])

    def engine(folder):
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(str(folder), dtype="bfloat16", num_gpu_blocks=512)

    base = engine(ref)
    base_sure, base_full = sure_and_full(base.generate(prompts, greedy, use_tqdm=False))
    del base
    quant = engine(path)
    held = int4_linears if kind == "int4" else quantized_linears
    assert len(held(quant.engine.model)) > 0
    assert torch.all(ranks(quant, base_full)[base_sure] == 1)
    quant_sure, quant_full = sure_and_full(quant.generate(prompts, greedy, use_tqdm=False))
    del quant
    base = engine(ref)
    assert torch.all(ranks(base, quant_full)[quant_sure] == 1)
