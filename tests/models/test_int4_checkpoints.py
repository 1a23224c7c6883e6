"""AWQ and GPTQ 4-bit checkpoints (config.json's quantization_config: quant_method awq /
gptq, bits 4), read with no flag and kept 4-bit (models/int4_checkpoint.py,
models/int4_formats.py, layers/int4.py).

Each test checkpoint is a tiny random model whose linears our own group quantizer
(``quantize_int4``) rounds to 4 bits, written in AWQ's or GPTQ's packing with fp16 scales;
its reference twin holds the same weights dequantized ((q - z) * s, fp32) under a plain
config. Checked: the config's parsing and its errors, which layers keep int4, the loaded
weights against the quantizer's (to the bit), our kernel over the loaded layout, the
engine's greedy tokens against transformers' over the twin, broken files, ``flashpage
inspect``; on the GPU (skipped without one) bf16 with graphs and our kernels."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpage.config import CheckpointQuantization, ConfigError, ModelConfig
from flashpage.kernels.int4_gemm import unpack_int4, w4a16_gemm, w4a16_matmul
from flashpage.kernels.int4_gemv import int4_gemv
from flashpage.layers.int4 import GEMV_ROWS, int4_linears
from flashpage.models.int4_formats import awq_tensors, gptq_tensors, quantize_int4
from flashpage.models.loader import ModelLoadError
from tests.conftest import edited_copy, hf_greedy, random_prompts

GPU = torch.cuda.is_available()
OURS = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
        "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}

# name -> quantization_config, group size, symmetric, modules the file leaves 16-bit
FORMATS: dict[str, dict] = {
    # HF's AwqConfig as AutoAWQ writes it; layer 1's v_proj left 16-bit, so its qkv_proj is
    # dequantized (one merged linear cannot be half int4)
    "awq_g32": dict(config={"quant_method": "awq", "bits": 4, "group_size": 32,
                            "zero_point": True, "version": "gemm",
                            "modules_to_not_convert": ["model.layers.1.self_attn.v_proj"]},
                    group=32, sym=False, skip=("model.layers.1.self_attn.v_proj",)),
    # AutoGPTQ's asymmetric form, zero biases stored for the bias-less linears
    "gptq_g32": dict(config={"quant_method": "gptq", "bits": 4, "group_size": 32,
                             "desc_act": False, "sym": False, "checkpoint_format": "gptq",
                             "damp_percent": 0.01, "true_sequential": True}, group=32, sym=False,
                     zero_bias=True),
    # symmetric, one group per row (group_size -1), the LM head quantized too (GPTQModel's
    # lm_head: true): it has no int4 home and comes dequantized
    "gptq_row_sym": dict(config={"quant_method": "gptq", "bits": 4, "group_size": -1,
                                 "desc_act": False, "sym": True, "lm_head": True}, group=None,
                         sym=True, lm_head=True),
}


def build_int4_checkpoint(src: Path, dst: Path, ref: Path, fmt: str,
                          is_linear=None) -> dict[str, torch.Tensor]:
    """Write ``dst`` (``src`` quantized in format ``fmt``) and ``ref`` (the same weights
    dequantized, fp32, no quantization_config). Returns {module: q [N, K]} of every module
    the file holds in int4. ``is_linear(name, tensor)``: which tensors are the linears'
    weights (default: Llama's ``*_proj.weight``)."""
    spec = FORMATS[fmt]
    tensors = load_file(str(src / "model.safetensors"))
    out, deq, qs = {}, {}, {}
    for name, w in tensors.items():
        mod = name.removesuffix(".weight")
        linear = (is_linear(name, w) if is_linear is not None
                  else name.endswith(".weight") and "_proj" in mod.rsplit(".", 1)[-1])
        if not (linear or (mod == "lm_head" and spec.get("lm_head"))) or mod in spec.get("skip", ()):
            out[name] = deq[name] = w
            continue
        q, s, z = quantize_int4(w, spec["group"], spec["sym"])
        packed = (awq_tensors if fmt.startswith("awq") else gptq_tensors)(q, s, z)
        out.update({f"{mod}.{k}": v for k, v in packed.items()})
        if spec.get("zero_bias") and f"{mod}.bias" not in tensors:
            out[f"{mod}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        g = spec["group"] or w.shape[1]
        deq[name] = (q.float() - z.float().repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1)
        qs[mod] = q
    for folder, data, quant in ((dst, out, True), (ref, deq, False)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        cfg = json.loads((src / "config.json").read_text())
        if quant:
            cfg["quantization_config"] = spec["config"]
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(data, str(folder / "model.safetensors"))
    return qs


@pytest.fixture(scope="module")
def int4_checkpoint(tiny_checkpoint, tmp_path_factory):
    """(model, format) -> (int4 folder, reference folder, {module: q}), built once."""
    cache: dict[tuple[str, str], tuple[Path, Path, dict[str, torch.Tensor]]] = {}

    def get(model: str, fmt: str):
        if (model, fmt) not in cache:
            root = tmp_path_factory.mktemp(f"{model}_{fmt}")
            qs = build_int4_checkpoint(tiny_checkpoint(model), root / "q", root / "ref", fmt)
            cache[model, fmt] = (root / "q", root / "ref", qs)
        return cache[model, fmt]

    return get


def _load(path, quantization=None, dtype=torch.float32):
    from flashpage.models.loader import load_model, resolve_model

    return load_model(resolve_model(str(path), None), dtype, torch.device("cpu"),
                      quantization=quantization)


# ----------------------------------------------------------------------------- config
def test_formats_parse():
    got = {fmt: CheckpointQuantization.from_dict(spec["config"], fmt)
           for fmt, spec in FORMATS.items()}
    assert got["awq_g32"] == CheckpointQuantization(
        "awq", "group", None, "dynamic", ("model.layers.1.self_attn.v_proj",), 4, 32)
    assert got["gptq_g32"] == CheckpointQuantization("gptq", "group", bits=4, group_size=32)
    assert got["gptq_row_sym"].group_size is None and got["gptq_row_sym"].is_int4
    # AutoAWQ's own quant_config keys (w_bit, q_group_size, version "GEMM")
    old = CheckpointQuantization.from_dict({"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                                            "zero_point": True, "version": "GEMM"}, "c")
    assert (old.bits, old.group_size) == (4, 128)
    assert got["awq_g32"].describe() == ("int4 (awq, groups of 32, fp16 scales and zero points), "
                                         "1 module(s) left 16-bit")


def _loop_pack(cols: torch.Tensor, order: list[int]) -> torch.Tensor:
    """The packers as AutoAWQ / AutoGPTQ describe them, one word at a time: int [R, C] ->
    int32 [R, C/8], nibble i of word c = column 8c + order[i]."""
    out = torch.zeros(cols.shape[0], cols.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i in range(8):
            out[:, c] |= cols[:, 8 * c + order[i]].to(torch.int64) << (4 * i)
    return out.to(torch.uint32).view(torch.int32)


def test_packings_are_awq_and_gptq_ones():
    """Our writers against the formats' word-by-word packers: AWQ packs 8 output columns
    in the order 0 2 4 6 1 3 5 7; GPTQ 8 input rows of a column in order (qweight) and its
    zero points minus one along the output columns in order (qzeros)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)
    q, s, z = quantize_int4(w, 32)
    awq = awq_tensors(q, s, z)
    assert torch.equal(awq["qweight"], _loop_pack(q.t(), [0, 2, 4, 6, 1, 3, 5, 7]))
    assert torch.equal(awq["qzeros"], _loop_pack(z.t(), [0, 2, 4, 6, 1, 3, 5, 7]))
    assert torch.equal(awq["scales"], s.t())
    gptq = gptq_tensors(q, s, z)
    assert torch.equal(gptq["qweight"], _loop_pack(q, list(range(8))).t())
    assert torch.equal(gptq["qzeros"], _loop_pack(z.t().long() - 1, list(range(8))))
    assert torch.equal(gptq["g_idx"], torch.arange(64, dtype=torch.int32) // 32)
    one = torch.arange(8)[None]
    assert _loop_pack(one, [0, 2, 4, 6, 1, 3, 5, 7]).item() == 0x75316420


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize("qc,match", [
    ({**AWQ, "bits": 8}, r"quantization_config.bits 8 is not supported \(awq checkpoints are read at 4 bits\)"),
    ({**GPTQ, "bits": 3}, r"quantization_config.bits 3 is not supported"),
    ({**AWQ, "version": "gemv"}, r"quantization_config.version 'gemv' is not supported"),
    ({**AWQ, "version": "exllama"}, r"quantization_config.version 'exllama' is not supported"),
    ({**AWQ, "zero_point": False}, r"quantization_config.zero_point False is not supported"),
    ({**AWQ, "group_size": 100}, r"quantization_config.group_size must be -1 .* got 100"),
    ({**AWQ, "group_size": None}, r"quantization_config.group_size must be -1 .* got None"),
    ({**GPTQ, "desc_act": True}, r"quantization_config.desc_act True is not supported \(act-order"),
    ({**GPTQ, "checkpoint_format": "gptq_v2"},
     r"quantization_config.checkpoint_format 'gptq_v2' is not supported"),
    ({**GPTQ, "checkpoint_format": "marlin"},
     r"quantization_config.checkpoint_format 'marlin' is not supported"),
    ({**GPTQ, "is_marlin_format": True}, r"quantization_config.is_marlin_format True is not supported"),
    ({**GPTQ, "sym": "yes"}, r"quantization_config.sym 'yes' is not supported \(true or false\)"),
    ({**AWQ, "modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list"),
])
def test_unsupported_int4_configs_are_named(qc, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**BASE, "quantization_config": qc})


def test_int4_is_read_for_the_dense_families_and_the_llama_moe_ones():
    """The Llama family and the dense ones on its body (tests/models/test_quant_families.py
    loads them), and Mixtral / Qwen2-MoE / Qwen3-MoE (tests/models/test_int4_moe_experts.py);
    not DeepSeek's MLA / MoE."""
    ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "quantization_config": GPTQ})
    ModelConfig.from_hf({**BASE, "architectures": ["Phi3ForCausalLM"], "quantization_config": GPTQ})
    moe = ModelConfig.from_hf({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "quantization_config": GPTQ})
    assert moe.n_routed_experts == 8 and moe.quantization_config.is_int4
    with pytest.raises(ConfigError, match=r"gptq \(int4\) checkpoints are read for the dense "
                                          r"Llama, Gemma and Llama-variant families and Mixtral / "
                                          r"Qwen2-MoE / Qwen3-MoE, not DeepseekV3ForCausalLM"):
        ModelConfig.from_hf({**BASE, "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 32,
                             "quantization_config": GPTQ})


def test_quantization_flag_names_awq_and_gptq():
    from flashpage.config import check_quantization

    with pytest.raises(ValueError, match=r"got 'awq' \(awq checkpoints are read as they are.*no flag"):
        check_quantization("awq")


# ----------------------------------------------------------------------------- loading
def _expected_int4(qs: dict[str, torch.Tensor]) -> list[str]:
    return [f"model.layers.{i}.{ours}" for i in range(2) for ours, hf in OURS.items()
            if all(f"model.layers.{i}.{ours.split('.')[0]}.{h}" in qs for h in hf)]


@pytest.mark.parametrize("model,fmt", [("llama31_gqa", "awq_g32"), ("qwen2_bias", "gptq_g32"),
                                       ("tied", "gptq_row_sym"), ("llama31_gqa", "gptq_row_sym")])
def test_loaded_weights_are_the_quantizers_to_the_bit(int4_checkpoint, model, fmt):
    """Every merged linear whose pieces are all int4 keeps them packed (q, k and v stacked
    along N), the nibbles the quantizer chose; every weight, read back in HF's names,
    equals the quantizer's dequantized value exactly (the dequantized LM head too); the
    kernel over the loaded layout is the dequantized weight's linear; inspect's weight
    bytes are the model's."""
    from flashpage.bench.common import weight_bytes
    from flashpage.inspect import inspect_config

    path, ref, qs = int4_checkpoint(model, fmt)
    m = _load(path)
    assert int4_linears(m) == _expected_int4(qs) != []
    want = load_file(str(ref / "model.safetensors"))
    got = dict(m.hf_weights())
    assert set(got) >= set(want) - {"lm_head.weight"}
    for name, w in want.items():
        if name in got:
            assert torch.equal(got[name], w), name
    qkv = m.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int32 and qkv.w4_zeros.dtype == torch.uint8
    assert qkv.w4_scales.dtype == torch.float16
    pieces = [qs[f"model.layers.0.self_attn.{h}"] for h in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(unpack_int4(qkv.weight), torch.cat(pieces))
    assert qkv.in_features == 64
    dev = "cuda" if GPU else "cpu"  # the CPU: the interpreter
    x = torch.randn(3, qkv.in_features)
    on = [t.to(dev) if t is not None else None
          for t in (x, qkv.weight, qkv.w4_scales, qkv.w4_zeros, qkv.bias)]
    y = w4a16_matmul(*on).cpu()
    lin = x @ got["model.layers.0.self_attn.q_proj.weight"].t()
    if qkv.bias is not None:
        lin = lin + qkv.bias[:lin.shape[1]]
    torch.testing.assert_close(y[:, :lin.shape[1]], lin, atol=1e-4, rtol=1e-4)
    info = inspect_config(ModelConfig.from_hf(path), 1 << 30, "fp32")
    assert info["weights_bytes"] == weight_bytes(m)
    assert info["int4_linears"] == len(int4_linears(m))


def test_quantization_fp8_leaves_int4_linears(int4_checkpoint):
    path, _, qs = int4_checkpoint("llama31_gqa", "awq_g32")
    m = _load(path, "fp8")
    assert int4_linears(m) == _expected_int4(qs)
    from flashpage.layers.quant import quantized_linears

    assert quantized_linears(m) == []  # layer 1's qkv_proj was left (partly) 16-bit by the file


def _generate(path, prompts, max_tokens=10):
    from flashpage import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True),
                        use_tqdm=False)
    n = len(int4_linears(llm.engine.model))
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs], n


@pytest.mark.parametrize("model,fmt", [("llama31_gqa", "awq_g32")])
def test_engine_tokens_equal_transformers_on_the_dequantized_checkpoint(int4_checkpoint, model,
                                                                        fmt):
    """LLM(int4 checkpoint) with no flag, fp32 on the CPU: transformers' greedy tokens over
    the dequantized fp32 twin (GPTQ on Qwen2: the test after this one, through our kernel)."""
    path, ref, _ = int4_checkpoint(model, fmt)
    prompts = random_prompts(3, 3, 20, seed=3)
    tokens, n = _generate(path, prompts)
    assert n > 0
    assert tokens == hf_greedy(ref, prompts, 10)


@pytest.mark.skipif(GPU, reason="the CPU variant (on a GPU the engine runs our kernel itself: "
                               "test_int4_checkpoint_bf16_on_the_gpu_with_graphs)")
def test_engine_tokens_through_our_kernel_under_the_interpreter(int4_checkpoint, monkeypatch):
    """The same with every int4 linear run by our Triton kernels (the interpreter stands in
    for the GPU; the CPU path would dequantize in torch): the layout the loader built is the
    one the kernel reads, inside the model."""
    import flashpage.layers.linear as linear_mod

    calls = []

    def kernel(x, qweight, scales, zeros, bias=None):
        calls.append(x.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        # the engine's CUDA kernels: the GEMV at decode rows, the swapped GEMM (past
        # GEMV_ROWS on CUDA) at the prompt steps, which here are shorter
        run = int4_gemv if x2.shape[0] <= min(2, GEMV_ROWS) else w4a16_gemm
        return run(x2, qweight, scales, zeros, bias).view(*x.shape[:-1], -1)

    monkeypatch.setattr(linear_mod, "int4_linear", kernel)
    path, ref, _ = int4_checkpoint("qwen2_bias", "gptq_g32")
    prompts = random_prompts(2, 3, 12, seed=4)
    tokens, _ = _generate(path, prompts, max_tokens=6)
    assert calls and max(calls) > 2 and min(calls) <= 2  # both kernels ran
    assert tokens == hf_greedy(ref, prompts, 6)


def test_lora_over_int4_linears(int4_checkpoint, tmp_path):
    """A LoRA adapter over the int4 checkpoint (its delta added to the int4 linear's output):
    the tokens of the dequantized twin with the adapter merged into its weights."""
    from flashpage import LLM, LoRARequest, SamplingParams
    from tests.peft_adapter import merge_adapter, write_adapter

    path, ref, _ = int4_checkpoint("llama31_gqa", "awq_g32")
    adapter = write_adapter(tmp_path / "a", ref, r=8, alpha=16, seed=5)
    merged = merge_adapter(ref, adapter, tmp_path / "merged")
    prompts = random_prompts(2, 4, 20, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", enable_lora=True, max_loras=1,
              max_lora_rank=8)
    got = llm.generate(prompts, greedy, lora_request=LoRARequest("a", 1, str(adapter)),
                       use_tqdm=False)
    del llm
    gc.collect()
    want, _ = _generate(merged, prompts, max_tokens=8)
    assert [o.outputs[0].token_ids for o in got] == want


# ----------------------------------------------------------------------------- broken files
def test_broken_int4_checkpoints_are_clear_errors(int4_checkpoint, tmp_path):
    path, _, _ = int4_checkpoint("qwen2_bias", "gptq_g32")
    m = "model.layers.0.self_attn.k_proj"
    act_order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).int() // 32
    cases = [
        (lambda t: t.pop(m + ".qzeros"), None, rf"{m}.qweight has no {m}.qzeros"),
        (lambda t: t.update({m + ".scales": torch.ones(3, 32, dtype=torch.float16)}), None,
         rf"{m}.scales has shape \[3, 32\], expected \[2, 32\]"),
        (lambda t: t.update({m + ".g_idx": act_order}), None,
         rf"{m}.g_idx is not k // group_size \(act-order"),
        (lambda t: t.update({m + ".qweight": t[m + ".qweight"].float()}), None,
         rf"{m}.qweight is F32, expected I32"),
        (None, lambda c: c["quantization_config"].update(group_size=48),
         r"model\.layers\.\d\.\S+: a \[\d+ in, \d+ out\] weight does not split into groups of 48"),
        (lambda t: [t.pop(k) for k in list(t) if k.endswith((".qweight", ".qzeros", ".scales",
                                                             ".g_idx"))], None,
         r"config.json says gptq \(int4\) but no tensor is a \*.qweight"),
        (None, lambda c: c.pop("quantization_config"), r"has no place in LlamaForCausalLM"),
    ]
    for i, (edit, config_edit, match) in enumerate(cases):
        bad = edited_copy(path, tmp_path / str(i), edit, config_edit)
        with pytest.raises((ModelLoadError, ValueError), match=match):
            _load(bad)


def test_inspect_reports_the_int4_quantization(int4_checkpoint, capsys):
    from flashpage.inspect import main

    path, _, _ = int4_checkpoint("llama31_gqa", "awq_g32")
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "int4 (awq, groups of 32, fp16 scales and zero points)" in out
    assert "kept in int4" in out and "int4 linears" in out
    assert main([str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantization_config"]["bits"] == 4
    assert info["quantization_config"]["group_size"] == 32
    assert info["int4_linears"] == 7  # 8 linears, layer 1's qkv_proj left 16-bit by the file


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["awq_g32", "gptq_g32"])
def test_int4_checkpoint_bf16_on_the_gpu_with_graphs(int4_checkpoint, fmt):
    """bf16 on CUDA, engine defaults (triton, CUDA graphs, the int4 GEMV at steps of 1-16
    rows, dequantize + cuBLAS above) against the bf16 engine over the dequantized checkpoint (the same weight
    values; only the order of the sums differs): each engine's greedy tokens, fed to the
    other as a prompt, are the other's top token wherever the first was sure. The int4
    engine's own decoding (graphs, split-K GEMV) and its prompt steps are both checked."""
    from flashpage import LLM, SamplingParams

    path, ref, _ = int4_checkpoint("head128_gqa", fmt)
    prompts = random_prompts(12, 3, 300, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    forced = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def sure_and_full(outs):
        margins = torch.tensor([lp.top[0][1] - lp.top[1][1] for o in outs
                                for lp in o.outputs[0].logprobs])
        return margins > 1.0, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]

    def ranks(llm, full):
        outs = llm.generate(full, forced, use_tqdm=False)
        return torch.tensor([e.rank for p, o in zip(prompts, outs, strict=True)
                             for e in o.prompt_logprobs[len(p):]])

    def engine(folder):
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(str(folder), dtype="bfloat16", num_gpu_blocks=1024)

    base = engine(ref)
    base_sure, base_full = sure_and_full(base.generate(prompts, greedy, use_tqdm=False))
    del base
    quant = engine(path)
    assert quant.engine.runner.graphs is not None
    assert len(int4_linears(quant.engine.model)) > 0
    assert torch.all(ranks(quant, base_full)[base_sure] == 1)  # int4 prompt steps
    quant_sure, quant_full = sure_and_full(quant.generate(prompts, greedy, use_tqdm=False))
    del quant
    base = engine(ref)
    assert torch.all(ranks(base, quant_full)[quant_sure] == 1)  # int4 decode steps (graphs)
