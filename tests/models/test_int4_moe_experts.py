"""AWQ and GPTQ int4 checkpoints of the Llama-body MoE families (Qwen3-MoE, Mixtral,
Qwen2-MoE): the routed experts' per-expert ``experts.{e}.{gate,up,down}_proj`` (Mixtral's
``w1 / w3 / w2``) qweight / qzeros / scales (/ g_idx) read into layers/moe.FusedExperts,
the attention and dense / shared-expert linears as the dense path reads them, the router
(``mlp.gate``) as stored (models/int4_checkpoint.py).

Each checkpoint is a tiny random model whose linears, experts included, our own group
quantizer rounds to 4 bits (tests/models/test_int4_checkpoints.build_int4_checkpoint);
its twin holds the same weights dequantized (fp32, no quantization_config). Checked on
the CPU (fp32): the loaded experts equal the twin's to the bit, the engine's greedy
tokens equal transformers' over the twin, a broken expert is a clear error."""

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
from tests.models.test_int4_checkpoints import build_int4_checkpoint

# the quantizers' linears: every *_proj (experts' too) and Mixtral's experts' w1 / w2 / w3;
# not the router (mlp.gate, block_sparse_moe.gate) nor Qwen2-MoE's shared_expert_gate
_LINEAR = re.compile(r"(_proj|\.w[123])\.weight$")
# name -> (tiny MoE model, its overrides): Qwen2-MoE's shared expert 64 wide (whole groups)
MODELS = {"qwen3_moe": ("qwen3_moe", {}), "mixtral": ("mixtral", {}),
          "qwen2_moe": ("qwen2_moe", dict(shared_expert_intermediate_size=64))}


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


def _experts(model) -> list[tuple[str, FusedExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedExperts)]


@pytest.mark.parametrize("model,fmt", [("qwen3_moe", "awq_g32"), ("mixtral", "gptq_g32"),
                                       ("qwen2_moe", "gptq_g32")])
def test_loaded_experts_are_the_dequantized_twins(int4_moe, model, fmt):
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

    info = inspect_config(ModelConfig.from_hf(path), 1 << 30, "fp32")
    assert info["weights_bytes"] == weight_bytes(m)
    assert info["int4_linears"] == len(kept)


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
