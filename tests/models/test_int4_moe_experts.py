"""AWQ and GPTQ int4 checkpoints of the Llama-body MoE families (Qwen3-MoE, Mixtral,
Qwen2-MoE): the routed experts' per-expert ``experts.{e}.{gate,up,down}_proj`` (Mixtral's
``w1 / w3 / w2``) qweight / qzeros / scales (/ g_idx) read into layers/moe.FusedExperts,
the attention and dense / shared-expert linears as the dense path reads them, the router
(``mlp.gate``) as stored (models/int4_checkpoint.py).

Each checkpoint is a tiny random model whose linears, experts included, our own group
quantizer rounds to 4 bits (tests/models/test_int4_checkpoints.build_int4_checkpoint);
its twin holds the same weights dequantized (fp32, no quantization_config). Checked on
the CPU (fp32): the loaded experts equal the twin's to the bit, the engine's greedy
tokens equal transformers' over the twin, a broken expert is a clear error. Kept packed
(FLASHPAGE_INT4_MOE=kernel, load_model(int4_moe_kernel=True)): the experts' words,
scales and zeros the file's to the bit, the torch paths (dequantizing per call) the
twin's to the bit, the fused int4 kernel (the interpreter) within fp32's order, the
engine's tokens the dequant path's; GPU (marked gpu): bf16 with graphs."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from safetensors.torch import load_file

from flashpage.layers.int4 import int4_linears
from flashpage.layers.moe import FusedExperts
from flashpage.models.loader import ModelLoadError
from tests.conftest import build_tiny_moe_checkpoint, edited_copy, hf_greedy, random_prompts
from tests.models.test_fp8_moe_experts import _experts, assert_kept_experts_follow_the_twin
from tests.models.test_int4_checkpoints import build_int4_checkpoint

GPU = torch.cuda.is_available()

# the quantizers' linears: every *_proj (experts' too) and Mixtral's experts' w1 / w2 / w3;
# not the router (mlp.gate, block_sparse_moe.gate) nor Qwen2-MoE's shared_expert_gate
_LINEAR = re.compile(r"(_proj|\.w[123])\.weight$")
# name -> (tiny MoE model, its overrides): Qwen2-MoE's shared expert 64 wide (whole groups)
# (qwen3_moe_gpu: heads of 32 for our CUDA kernels)
MODELS = {"qwen3_moe": ("qwen3_moe", {}), "mixtral": ("mixtral", {}),
          "qwen2_moe": ("qwen2_moe", dict(shared_expert_intermediate_size=64)),
          "qwen3_moe_gpu": ("qwen3_moe", dict(head_dim=32))}


@pytest.fixture(scope="module")
def int4_moe(tmp_path_factory):
    """(model, format) -> (int4 folder, dequantized twin, {module: q}), built once."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(model: str, fmt: str):
        if (model, fmt) not in cache:
            root = tmp_path_factory.mktemp(f"{model}_{fmt}")
            name, over = MODELS[model]
            src = build_tiny_moe_checkpoint(root / "src", name, **over)
            qs = build_int4_checkpoint(src, root / "q", root / "ref", fmt,
                                       is_linear=lambda n, w: _LINEAR.search(n) is not None)
            cache[model, fmt] = (root / "q", root / "ref", qs)
        return cache[model, fmt]

    return get


def _load(path, **kw):
    from flashpage.models.loader import load_model, resolve_model

    return load_model(resolve_model(str(path), None), torch.float32, torch.device("cpu"), **kw)


@pytest.mark.parametrize("model,fmt", [("qwen3_moe", "awq_g32"), ("mixtral", "gptq_g32"),
                                       ("qwen2_moe", "gptq_g32")])
def test_loaded_experts_are_the_dequantized_twins(int4_moe, model, fmt, monkeypatch):
    """The file quantized every expert (and the router not): the experts load dequantized
    to the model's dtype, every parameter the twin's to the bit (dequantized_parameters:
    the int4 linears too); attention and the dense / shared-expert MLPs keep int4 where
    the dense path would; the router is the file's 16-bit tensor."""
    from flashpage.layers.quant import dequantized_parameters

    path, ref, qs = int4_moe(model, fmt)
    expert_mods = [m for m in qs if ".experts." in m]
    assert expert_mods and not any(m.endswith((".gate", "shared_expert_gate")) for m in qs)
    m = _load(path)
    layers = _experts(m)
    assert layers
    assert all(x.gate_up_proj.dtype == torch.float32 for _, x in layers)
    kept = int4_linears(m)
    assert any("self_attn.o_proj" in k for k in kept)
    if model == "qwen2_moe":
        assert any("shared_expert.gate_up_proj" in k for k in kept)
    twin = _load(ref)
    mine, want = dict(dequantized_parameters(m)), dict(dequantized_parameters(twin))
    assert mine.keys() == want.keys()
    for n in want:
        assert torch.equal(mine[n], want[n]), n
    # one expert's rows against the file's own dequantized tensors (the twin's file)
    file = load_file(str(ref / "model.safetensors"))
    x = layers[-1][1]
    layer = layers[-1][0].split(".")[2]
    names = ({"gate": "w1", "up": "w3", "down": "w2"} if model == "mixtral"
             else {p: f"{p}_proj" for p in ("gate", "up", "down")})
    base = (f"model.layers.{layer}.block_sparse_moe.experts.5." if model == "mixtral"
            else f"model.layers.{layer}.mlp.experts.5.")
    assert torch.equal(x.gate_up_proj[5], torch.cat([file[base + names["gate"] + ".weight"],
                                                     file[base + names["up"] + ".weight"]]))
    assert torch.equal(x.down_proj[5], file[base + names["down"] + ".weight"])
    # flashpage inspect's weight bytes are the model's (the experts in its dtype)
    from flashpage.bench.common import weight_bytes
    from flashpage.config import ModelConfig
    from flashpage.inspect import inspect_config

    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "dequant")
    info = inspect_config(ModelConfig.from_hf(path), 1 << 30, "fp32")
    assert info["weights_bytes"] == weight_bytes(m)
    assert info["int4_linears"] == len(kept)
    assert not info["int4_experts_kept"] and info["int4_expert_bytes"] > 0


def _generate(path, prompts):
    from flashpage import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    n = len(int4_linears(llm.engine.model))
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs], n


@pytest.mark.parametrize("model,fmt", [("qwen3_moe", "awq_g32"), ("qwen3_moe", "gptq_g32"),
                                       ("mixtral", "gptq_g32"), ("qwen2_moe", "awq_g32")])
def test_engine_tokens_equal_transformers_on_the_dequantized_twin(int4_moe, model, fmt):
    """LLM(int4 MoE checkpoint), no flag, fp32 on the CPU: transformers' greedy tokens
    over the dequantized fp32 twin."""
    path, ref, _ = int4_moe(model, fmt)
    prompts = random_prompts(3, 3, 20, seed=5)
    tokens, n = _generate(path, prompts)
    assert n > 0
    assert tokens == hf_greedy(ref, prompts, 10)


@pytest.mark.parametrize(("qc", "match"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
     r"desc_act True is not supported \(act-order groups \(g_idx\) are not read\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"version 'gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"bits 8 is not supported"),
])
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_unread_int4_forms_of_moe_checkpoints_are_config_errors(arch, qc, match):
    """What the reader does not read (act-order, other packings, 8 bits) is a ConfigError
    naming the field on the MoE families as on the dense ones."""
    from flashpage.config import ConfigError, ModelConfig

    raw = {"architectures": [arch], "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_local_experts": 4, "num_experts": 4,
           "num_experts_per_tok": 2, "quantization_config": qc}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(raw)


def test_broken_int4_experts_are_clear_errors(int4_moe, tmp_path):
    """An act-order expert (g_idx not k // G), an expert's scales of the wrong shape, and
    a nonzero bias on an expert (ours have none) are errors naming the tensor."""
    path, _, _ = int4_moe("qwen3_moe", "gptq_g32")
    gate = "model.layers.1.mlp.experts.3.gate_proj"

    def shuffle(t):
        t[f"{gate}.g_idx"] = t[f"{gate}.g_idx"].flip(0).contiguous()

    with pytest.raises(ModelLoadError, match=rf"{gate}\.g_idx is not k // group_size "
                                             r"\(act-order"):
        _load(edited_copy(path, tmp_path / "actorder", shuffle))

    def narrow(t):
        t[f"{gate}.scales"] = t[f"{gate}.scales"][:, :8].contiguous()

    with pytest.raises(ModelLoadError, match=rf"{gate}\.scales has shape \[2, 8\], expected "
                                             r"\[2, 32\]"):
        _load(edited_copy(path, tmp_path / "narrow", narrow))

    def bias(t):
        t[f"{gate}.bias"] = torch.ones(32, dtype=torch.float16)

    with pytest.raises(ValueError, match=rf"{gate}\.bias"):
        _load(edited_copy(path, tmp_path / "bias", bias))


# ----------------------------------------------------------------------------- kept int4
@pytest.mark.parametrize("model,fmt", [("qwen3_moe", "gptq_g32"), ("mixtral", "awq_g32"),
                                       ("qwen2_moe", "gptq_g32")])
def test_kept_experts_are_the_files_to_the_bit(int4_moe, model, fmt, monkeypatch):
    """int4_moe_kernel: every MoE layer's experts hold int32 words [E, 2I, H/8] / [E, H, I/8]
    whose nibbles are the quantizer's (gate rows, then up), fp16 scales and uint8 zeros per
    group of 32, nothing 16/32-bit of theirs beside; dequantized_parameters gives back the
    twin's weights to the bit; inspect's weight bytes (kernel: kept) are the model's."""
    from flashpage.bench.common import weight_bytes
    from flashpage.config import ModelConfig
    from flashpage.inspect import inspect_config
    from flashpage.kernels.int4_gemm import unpack_int4
    from flashpage.layers.quant import dequantized_parameters

    path, ref, qs = int4_moe(model, fmt)
    m = _load(path, int4_moe_kernel=True)
    layers = _experts(m)
    assert layers and all(x.int4 for _, x in layers)
    names = ("w1", "w3", "w2") if model == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for prefix, x in layers:
        e, inter = x.num_experts, x.intermediate
        h = x.down_proj.shape[1]
        assert x.gate_up_proj.dtype == x.down_proj.dtype == torch.int32
        assert x.gate_up_proj.shape == (e, 2 * inter, h // 8)
        assert x.down_proj_w4_scales.shape == (e, h, inter // 32)
        assert x.gate_up_proj_w4_zeros.dtype == torch.uint8
        assert x.gate_up_proj_w4_scales.dtype == torch.float16
        hf = prefix.replace(".mlp.", ".block_sparse_moe.") if model == "mixtral" else prefix
        for i in range(e):
            gate, up, down = (qs[f"{hf}.{i}.{n}"] for n in names)
            assert torch.equal(unpack_int4(x.gate_up_proj[i]), torch.cat([gate, up]))
            assert torch.equal(unpack_int4(x.down_proj[i]), down)
        assert sorted(x.state_dict()) == sorted(
            f"{p}{s}" for p in ("gate_up_proj", "down_proj") for s in ("", "_w4_scales", "_w4_zeros"))
    twin = _load(ref)
    mine, want = dict(dequantized_parameters(m)), dict(dequantized_parameters(twin))
    assert mine.keys() == want.keys()
    for n in want:
        assert torch.equal(mine[n], want[n]), n
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "kernel")
    info = inspect_config(ModelConfig.from_hf(path), 1 << 30, "fp32")
    assert info["int4_experts_kept"] and info["weights_bytes"] == weight_bytes(m)


def test_every_expert_path_over_kept_experts(int4_moe):
    """Each FusedExperts path over kept int4 experts (fp32, CPU) against the dequantized
    twin's: gathered, every expert on every token and grouped (dequantized per call) equal
    to the bit; the fused int4 kernel (Triton's interpreter) within fp32's order."""
    path, ref, _ = int4_moe("qwen3_moe", "awq_g32")
    kept = _experts(_load(path, int4_moe_kernel=True))
    twin = _experts(_load(ref))
    g = torch.Generator().manual_seed(0)
    for (_, m), (_, r) in zip(kept, twin, strict=True):
        assert m.int4 and not r.int4
        for n in (1, 5):
            x = torch.randn(n, r.gate_up_proj.shape[2], generator=g)
            ids = torch.stack([torch.randperm(m.num_experts, generator=g)[:m.top_k]
                               for _ in range(n)])
            w = torch.rand(n, m.top_k, generator=g)
            for p in ("_gathered", "_all_experts"):
                assert torch.equal(getattr(m, p)(x, ids), getattr(r, p)(x, ids)), p
            assert torch.equal(m.forward_grouped(x, w, ids), r.forward_grouped(x, w, ids))
            want = r.forward_sync_free(x, w, ids)
            got = m.forward_fused(x, w, ids)
            assert ((got - want).norm() / want.norm()).item() < 1e-5


def _generate_kept(path, prompts):
    from flashpage import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    kept = [(n, m.fused_kernel) for n, m in _experts(llm.engine.model) if m.int4]
    del llm
    gc.collect()
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.top[0][1] for lp in o.outputs[0].logprobs] for o in outs], kept)


@pytest.mark.parametrize("model,fmt", [("qwen3_moe", "gptq_g32"), ("mixtral", "awq_g32")])
def test_engine_over_kept_experts_equals_the_dequant_path(int4_moe, model, fmt, monkeypatch):
    """fp32 on the CPU: FLASHPAGE_INT4_MOE=kernel keeps the experts (the torch paths
    dequantize per call: the dequant path's weights) and gives its greedy tokens and
    log-probabilities to the bit; auto on the CPU keeps none (no fused kernel here); the
    engine with the fused int4 kernel turned on (the interpreter standing in for CUDA)
    gives the same tokens."""
    import flashpage.engine.llm_engine as engine_mod

    path, _, _ = int4_moe(model, fmt)
    prompts = random_prompts(3, 3, 24, seed=11)
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "kernel")
    tokens, logprobs, kept = _generate_kept(path, prompts)
    assert kept and not any(f for _, f in kept)
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "dequant")
    deq_tokens, deq_logprobs, deq_kept = _generate_kept(path, prompts)
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "auto")
    _, _, auto_kept = _generate_kept(path, prompts[:1])
    assert deq_kept == auto_kept == []
    assert tokens == deq_tokens and logprobs == deq_logprobs

    def experts_fused(model, enabled):  # the engine's switch, the experts' half, always on
        for m in model.modules():
            if isinstance(m, FusedExperts):
                m.fused_kernel = True

    monkeypatch.setattr(engine_mod, "set_fused_moe", experts_fused)
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "kernel")
    fused_tokens, _, fused_kept = _generate_kept(path, prompts)
    assert fused_kept and all(f for _, f in fused_kept)
    assert fused_tokens == deq_tokens


def test_int4_moe_env_is_checked(monkeypatch):
    from flashpage import envs

    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "keep")
    with pytest.raises(ValueError, match="FLASHPAGE_INT4_MOE must be auto, dequant or kernel"):
        envs.int4_moe()
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", " Kernel ")
    assert envs.int4_moe() == "kernel"


def test_experts_the_kernel_cannot_take_are_dequantized(int4_moe, tmp_path, caplog):
    """A layer one of whose experts the file left 16-bit is dequantized with a warning
    naming why, even with int4_moe_kernel; its weights still equal the twin's."""
    path, ref, _ = int4_moe("qwen3_moe", "awq_g32")
    mod = "model.layers.1.mlp.experts.2.up_proj"
    twin = load_file(str(ref / "model.safetensors"))

    def unquantize(t):
        for part in (".qweight", ".qzeros", ".scales"):
            del t[mod + part]
        t[mod + ".weight"] = twin[mod + ".weight"]

    edited = edited_copy(path, tmp_path / "mixed", unquantize)
    with caplog.at_level("WARNING", logger="flashpage"):
        m = _load(edited, int4_moe_kernel=True)
    assert [x.int4 for _, x in _experts(m)] == [False]
    assert "not int4 in the file" in caplog.text
    (_, x), = _experts(m)
    assert torch.equal(x.gate_up_proj[2, 32:], twin[mod + ".weight"])


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_kept_int4_experts_bf16_on_the_gpu_with_graphs(int4_moe, monkeypatch):
    """bf16 on CUDA, engine defaults (auto: the experts kept int4 and run by the fused int4
    kernel, decode graphs captured): each greedy token of the bf16 engine over the
    dequantized twin, fed back, is the kept engine's top token where bf16 is sure (margin
    > 3) and most of the time elsewhere; the experts take about a quarter of the twin's
    bytes (plus their groups' scales and zeros)."""

    monkeypatch.delenv("FLASHPAGE_INT4_MOE", raising=False)
    path, ref, _ = int4_moe("qwen3_moe_gpu", "gptq_g32")
    assert_kept_experts_follow_the_twin(path, ref, "int4", 4)
