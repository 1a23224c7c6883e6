"""Online quantization of routed experts (``quantization="fp8"`` / ``"int4"`` / ``"rtn"``,
layers/quant.quantize_model -> layers/moe.FusedExperts.quantize_fp8 / quantize_int4): a
16-bit MoE checkpoint's experts held as a quantized checkpoint's are (hold_fp8: 128 x 128
block e4m3 with fp32 block scales; hold_int4: packed int4 groups, fp16 scales, uint8 zeros),
for kernels/fused_moe_fp8.py / fused_moe_int4.py, where FLASHPAGE_FP8_MOE /
FLASHPAGE_INT4_MOE keep them (kernel: everywhere; auto: where the fused kernel runs, CUDA).

CPU (fp32; tiny random Qwen3-MoE, Mixtral and DeepSeek-V2 of hidden and expert sizes 128):
the held values are our quantizers' own (per-block amax / 448; models/int4_formats.
quantize_int4), within the formats' rounding of the 16-bit weights; each layer's output
within a bound the rounding justifies of the 16-bit layer's; the engine's greedy tokens and
log-probabilities equal, to the bit, those of the engine over the same checkpoint with its
experts 16-bit and overwritten by the held weights dequantized (the torch paths dequantize
per call to those very weights), every KV block back at the end; the env switches off
(dequant) or experts the kernels cannot take leave them 16-bit, saying so; random weights
(``bench throughput --no-hf --quantization fp8``) run. GPU (marked gpu): bf16 with CUDA
graphs, the fused kernels against that dequantized twin."""

from __future__ import annotations

import copy
import gc
import json
import logging

import pytest
import torch

from flashpage.kernels.fp8_block_ref import dequantize_experts_fp8, quantize_fp8_block
from flashpage.kernels.fused_moe_int4 import dequantize_experts_int4
from flashpage.kernels.int4_gemm import pack_int4
from flashpage.layers.moe import FusedExperts
from flashpage.layers.quant import quantize_model
from flashpage.models.int4_formats import quantize_int4
from tests.conftest import build_tiny_mla_checkpoint, build_tiny_moe_checkpoint, random_prompts

GPU = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
WIDE = dict(hidden_size=128, moe_intermediate_size=128)
ENV = {"fp8": "FLASHPAGE_FP8_MOE", "int4": "FLASHPAGE_INT4_MOE"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """name -> a tiny fp32 MoE checkpoint, built once: qwen3_moe (top-3 of 8, layer 0 dense),
    mixtral (top-2 of 8, every layer), deepseek_v2 (MLA, a shared expert), qwen3_moe_narrow
    (expert intermediate 64: half a 128-block), qwen3_moe_gpu (heads of 32 for our CUDA
    kernels)."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            if name == "deepseek_v2":
                cache[name] = build_tiny_mla_checkpoint(root, name, fan_in_init=True, **WIDE)
            elif name == "mixtral":  # Mixtral's experts are intermediate_size wide
                cache[name] = build_tiny_moe_checkpoint(root, name, hidden_size=128,
                                                        intermediate_size=128)
            elif name == "qwen3_moe_narrow":
                cache[name] = build_tiny_moe_checkpoint(root, "qwen3_moe", hidden_size=128,
                                                        moe_intermediate_size=64)
            elif name == "qwen3_moe_gpu":
                cache[name] = build_tiny_moe_checkpoint(root, "qwen3_moe", head_dim=32, **WIDE)
            else:
                cache[name] = build_tiny_moe_checkpoint(root, name, **WIDE)
        return cache[name]

    return get


def _experts(model) -> list[tuple[str, FusedExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedExperts)]


def _load(path, **kw):
    from flashpage.models.loader import load_model, resolve_model

    return load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), **kw)


# ----------------------------------------------------------------------------- the layers
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_fp8_experts_are_our_block_quantizers(moe, name):
    """quantize_model("fp8", experts=True): every MoE layer's experts hold e4m3 [E, 2I, H] /
    [E, H, I] and fp32 scales [E, 2I/128, H/128] / [E, H/128, I/128], each expert's values
    and scales quantize_fp8_block's of its 16-bit weights to the bit, every value within
    e4m3's rounding of the weight (half an ulp: 2^-4 relative for normals, 2^-10 of the
    block's scale below them); nothing 16-bit of theirs left, the experts a quarter of
    their fp32 bytes plus the scales; the count and log name them."""
    model = _load(moe(name))
    before = {n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
              for n, m in _experts(model)}
    assert before
    linears = quantize_model(copy.deepcopy(model), "fp8", experts=False)
    assert quantize_model(model, "fp8", experts=True) == linears + len(before)
    for path, m in _experts(model):
        assert m.fp8 and not m.int4
        assert m.gate_up_proj.dtype == m.down_proj.dtype == FP8
        e, inter, h = m.num_experts, m.intermediate, m.gate_up_proj.shape[2]
        assert m.gate_up_proj_scale.shape == (e, 2 * inter // 128, h // 128)
        assert m.down_proj_scale.shape == (e, h // 128, inter // 128)
        assert m.gate_up_proj_scale.dtype == m.down_proj_scale.dtype == torch.float32
        assert sorted(m.state_dict()) == ["down_proj", "down_proj_scale", "gate_up_proj",
                                          "gate_up_proj_scale"]
        w_bytes = sum(w.nbytes for w in before[path])
        assert m.expert_bytes() == w_bytes // 4 + 4 * (m.gate_up_proj_scale.numel()
                                                       + m.down_proj_scale.numel())
        for proj, w in zip(("gate_up_proj", "down_proj"), before[path], strict=True):
            q, s = getattr(m, proj), getattr(m, f"{proj}_scale")
            for i in range(e):
                wq, ws = quantize_fp8_block(w[i], (128, 128))
                assert torch.equal(q[i].view(torch.uint8), wq.view(torch.uint8))
                assert torch.equal(s[i], ws)
            deq = dequantize_experts_fp8(q, s, torch.float32)
            block = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
            err = (deq - w).abs()
            assert torch.all(err <= torch.maximum(w.abs() * 2**-4, block * 2**-10) * (1 + 1e-6))
            assert torch.all(s == w.float().view(e, s.shape[1], 128, s.shape[2], 128)
                             .abs().amax(dim=(2, 4)) / 448)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_int4_experts_are_our_group_quantizers(moe, name):
    """quantize_model("int4", experts=True): packed int32 [E, 2I, H/8] / [E, H, I/8], fp16
    scales and uint8 zeros per group of 128 along K (int4_group_for), each expert's rows
    quantize_int4's of its 16-bit weights, packed; every value within half a step of its
    group ((q - z) * s rounds to nearest) of the weight; 1/8 of the fp32 bytes plus 3 bytes
    a group."""
    model = _load(moe(name))
    before = {n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
              for n, m in _experts(model)}
    quantize_model(model, "int4", experts=True)
    for path, m in _experts(model):
        assert m.int4 and not m.fp8
        assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.int32
        groups = 0
        for proj, w in zip(("gate_up_proj", "down_proj"), before[path], strict=True):
            words = getattr(m, proj)
            s, z = getattr(m, f"{proj}_w4_scales"), getattr(m, f"{proj}_w4_zeros")
            e, n, k = w.shape
            assert words.shape == (e, n, k // 8)
            assert s.shape == z.shape == (e, n, k // 128)
            assert s.dtype == torch.float16 and z.dtype == torch.uint8
            for i in range(e):
                q, ws, wz = quantize_int4(w[i], 128)
                assert torch.equal(words[i], pack_int4(q))
                assert torch.equal(s[i], ws) and torch.equal(z[i], wz)
            deq = dequantize_experts_int4(words, s, z, torch.float32)
            step = s.float().repeat_interleave(128, 2)
            # (a hair past half a step at the range's ends: 15 steps of an fp16-rounded scale)
            assert torch.all((deq - w).abs() <= step * 0.52)
            groups += s.numel()
        w_bytes = sum(w.nbytes for w in before[path])
        assert m.expert_bytes() == w_bytes // 8 + 3 * groups


@pytest.mark.parametrize("group,want", [("64", 64), ("-1", None)])
def test_rtn_experts_take_the_methods_group_size(moe, monkeypatch, group, want):
    """vLLM's "rtn" (RTN_NUM_BITS=4) quantizes the experts in RTN_GROUP_SIZE groups along
    each projection's K (-1: one group a row), as it does the linears."""
    monkeypatch.setenv("RTN_NUM_BITS", "4")
    monkeypatch.setenv("RTN_GROUP_SIZE", group)
    model = _load(moe("qwen3_moe"))
    w = model.model.layers[1].mlp.experts.down_proj.detach().clone()
    quantize_model(model, "rtn", experts=True)
    m = model.model.layers[1].mlp.experts
    assert m.int4
    for proj in ("gate_up_proj", "down_proj"):
        k = getattr(m, proj).shape[2] * 8
        assert getattr(m, f"{proj}_w4_scales").shape[2] == k // (want or k)
    q, s, z = quantize_int4(w[3], want)
    assert torch.equal(m.down_proj[3], pack_int4(q)) and torch.equal(m.down_proj_w4_scales[3], s)


@pytest.mark.parametrize("method", ["fp8", "int4"])
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2"])
def test_quantized_layers_stay_close_to_the_16bit_ones(moe, name, method):
    """Each MoE layer's output (sync-free and grouped paths, 1 and 40 tokens) over the
    quantized experts against the fp32 layer's: relative error (Frobenius) under 0.1 for
    fp8 (each weight within 2^-4 relative: about 2^-4 / sqrt(3) RMS, through two
    projections) and 0.25 for int4 (half a step of (max - min) / 15 a group: ~10% of the
    weights' RMS); experts whose values were garbage or misplaced would be off by ~1.
    The fused kernel (Triton's interpreter) over the held weights equals the torch path's
    within fp32's summation order."""
    model = _load(moe(name))
    ref = copy.deepcopy(model)
    quantize_model(model, method, experts=True)
    g = torch.Generator().manual_seed(1)
    bound = 0.1 if method == "fp8" else 0.25
    for (_, m), (_, r) in zip(_experts(model), _experts(ref), strict=True):
        for n in (1, 40):
            x = torch.randn(n, r.gate_up_proj.shape[2], generator=g)
            ids = torch.stack([torch.randperm(m.num_experts, generator=g)[:m.top_k]
                               for _ in range(n)])
            w = torch.rand(n, m.top_k, generator=g)
            want = r.forward_sync_free(x, w, ids)
            for got in (m.forward_sync_free(x, w, ids), m.forward_grouped(x, w, ids)):
                rel = ((got - want).norm() / want.norm()).item()
                assert 1e-4 < rel < bound, rel  # (above 0: the experts did change)
            fused = m.forward_fused(x, w, ids)
            torch_path = m.forward_sync_free(x, w, ids)
            assert ((fused - torch_path).norm() / torch_path.norm()).item() < 1e-5


def test_experts_the_kernels_cannot_take_stay_16bit(moe, caplog):
    """Expert intermediate 64 (half a 128-block): "fp8" leaves them fp32 with a warning
    naming the layer and why (the linears are quantized); "int4" takes them (groups of 64
    along the down projection's K). GPT-OSS's experts (biases, clamped SwiGLU) stay 16-bit
    under both."""
    from flashpage.config import ModelConfig
    from flashpage.kernels.fused_moe import ClampedSwiGLU

    model = _load(moe("qwen3_moe_narrow"))
    with caplog.at_level(logging.WARNING, logger="flashpage"):
        n = quantize_model(model, "fp8", experts=True)
    layers = _experts(model)
    assert n > 0 and all(not m.fp8 and m.gate_up_proj.dtype == torch.float32 for _, m in layers)
    assert "1 MoE layers' routed experts left 16-bit" in caplog.text
    assert "model.layers.1.mlp.experts (hidden size 128 or expert intermediate size 64 not a " \
           "multiple of 128)" in caplog.text
    model = _load(moe("qwen3_moe_narrow"))
    quantize_model(model, "int4", experts=True)
    layers = _experts(model)
    assert all(m.int4 for _, m in layers)
    assert layers[0][1].down_proj_w4_scales.shape[2] == 1  # one group of 64 a row
    cfg = ModelConfig.from_hf(moe("qwen3_moe"))
    gpt_oss = FusedExperts(cfg, bias=True, activation=ClampedSwiGLU(1.702, 7.0))
    for method in ("fp8", "int4"):
        assert "biases or GPT-OSS's activation" in (
            gpt_oss.fp8_unsupported() if method == "fp8" else gpt_oss.int4_unsupported(128))
        with pytest.raises(ValueError, match="cannot be quantized"):
            if method == "fp8":
                gpt_oss.quantize_fp8()
            else:
                gpt_oss.quantize_int4(128, 128)


def test_default_follows_the_env_switches(moe, monkeypatch, caplog):
    """quantize_model with no ``experts``: FLASHPAGE_FP8_MOE / FLASHPAGE_INT4_MOE kernel
    quantizes them, dequant leaves them 16-bit (an info line says so), auto on the CPU too
    (no fused kernel here)."""
    for method in ("fp8", "int4"):
        for mode, kept in (("kernel", True), ("dequant", False), ("auto", False)):
            monkeypatch.setenv(ENV[method], mode)
            model = _load(moe("qwen3_moe"))
            with caplog.at_level(logging.INFO, logger="flashpage"):
                caplog.clear()
                quantize_model(model, method)
            assert all(getattr(m, method) is kept for _, m in _experts(model)), (method, mode)
            assert ("routed experts left 16-bit" in caplog.text) is not kept
            assert ("MoE layers' routed experts 1.5 MiB ->" in caplog.text) is kept


# ----------------------------------------------------------------------------- the engine
def _llm(path, method, **kw):
    from flashpage import LLM

    return LLM(str(path), device="cpu", dtype="float32", quantization=method, **kw)


def _run(llm, prompts):
    from flashpage import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_usable_blocks  # every block back
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.top[0][1] for lp in o.outputs[0].logprobs] for o in outs])


def _held_dequantized(model, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's experts as the torch paths use them: dequantized to ``dtype``."""
    return [(m._weight("gate_up_proj", dtype), m._weight("down_proj", dtype))
            for _, m in _experts(model)]


def _overwrite_experts(model, weights) -> None:
    """The 16-bit experts of ``model`` set to ``weights`` (in place: graphs keep reading them)."""
    layers = _experts(model)
    assert len(layers) == len(weights)
    for (_, m), (gate_up, down) in zip(layers, weights, strict=True):
        assert not (m.fp8 or m.int4)
        m.gate_up_proj.data.copy_(gate_up)
        m.down_proj.data.copy_(down)


@pytest.mark.parametrize("method", ["fp8", "int4"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_engine_over_quantized_experts_equals_their_dequantized_twin(moe, name, method,
                                                                     monkeypatch):
    """LLM(quantization=method), fp32 on the CPU, the experts kept (the env switch
    "kernel"): greedy tokens and log-probabilities equal, to the bit, those of the same
    LLM with the switch "dequant" (experts 16-bit, the linears quantized alike) whose
    experts are overwritten by the kept ones dequantized; without the overwrite (the
    experts' true 16-bit weights) the log-probabilities differ. Every KV block is back
    after each run (the twin runs twice: no prefix caching, so the second computes anew)."""
    path = moe(name)
    prompts = random_prompts(4, 3, 40, seed=7)
    monkeypatch.setenv(ENV[method], "kernel")
    llm = _llm(path, method)
    layers = _experts(llm.engine.model)
    assert layers and all(getattr(m, method) for _, m in layers)
    tokens, logprobs = _run(llm, prompts)
    held = _held_dequantized(llm.engine.model, torch.float32)
    del llm
    gc.collect()
    monkeypatch.setenv(ENV[method], "dequant")
    twin = _llm(path, method, enable_prefix_caching=False)  # no KV of the first run reused
    assert all(m.gate_up_proj.dtype == torch.float32 for _, m in _experts(twin.engine.model))
    _, own_logprobs = _run(twin, prompts)
    _overwrite_experts(twin.engine.model, held)
    twin_tokens, twin_logprobs = _run(twin, prompts)
    assert tokens == twin_tokens
    assert logprobs == twin_logprobs
    assert own_logprobs != logprobs


def test_random_weights_bench_runs_the_quantized_experts(moe, tmp_path, monkeypatch, caplog):
    """``flashpage bench throughput --config X --no-hf --quantization fp8`` (random weights:
    the loader's init, then quantize_model) on a tiny MoE shape, CPU, FLASHPAGE_FP8_MOE=
    kernel: the experts are quantized (the log line counts them) and the run completes;
    LLM(random_weights_config=..., quantization="int4") likewise generates, every KV block
    back."""
    from flashpage import LLM, SamplingParams
    from flashpage.cli import main

    cfg = moe("qwen3_moe") / "config.json"
    out = tmp_path / "t.json"
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "kernel")
    with caplog.at_level(logging.INFO, logger="flashpage"):
        assert main(["bench", "throughput", "--config", str(cfg), "--num-requests", "4",
                     "--input-len", "8", "24", "--output-len", "4", "8", "--no-hf",
                     "--quantization", "fp8", "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["quantization"] == "fp8" and r["flashpage"]["output_tok_per_s"] > 0
    assert "1 MoE layers' routed experts" in caplog.text
    monkeypatch.setenv("FLASHPAGE_INT4_MOE", "kernel")
    llm = LLM(random_weights_config=str(cfg.parent), quantization="int4", device="cpu",
              dtype="float32")
    assert all(m.int4 for _, m in _experts(llm.engine.model))
    outs = llm.generate(random_prompts(3, 4, 20, seed=2),
                        SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_usable_blocks


# ----------------------------------------------------------------------------- GPU
def _forced(llm, prompts, outs) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranks, log-probabilities) under ``llm`` of each token ``outs`` generated after
    ``prompts``, fed back as prompts."""
    from flashpage import SamplingParams

    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
    forced = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    entries = [e for p, o in zip(prompts, forced, strict=True) for e in o.prompt_logprobs[len(p):]]
    return torch.tensor([e.rank for e in entries]), torch.tensor([e.logprob for e in entries])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("method,ratio", [("fp8", 2), ("int4", 4)])
def test_quantized_experts_bf16_on_the_gpu_with_graphs(moe, method, ratio, monkeypatch):
    """bf16 on CUDA, engine defaults (auto: the experts quantized at load and run by the
    fused fp8 / int4 kernel, decode graphs captured; 1 / ``ratio`` of the bf16 bytes).
    Against the twin (the same engine with the experts left bf16, the switch "dequant",
    then overwritten by the held weights dequantized): each greedy token of the twin, fed
    back, is the quantized engine's top token where the twin is sure (margin > 3) and
    most of the time elsewhere (the rule of test_fp8_moe_experts' GPU test: W8A8 rounds
    the activations too). Against the 16-bit model (no quantization): the log-probability
    of its greedy tokens moves on average no more with the experts quantized than with
    them left bf16 (the linears quantized alike) times 1.25 plus 0.05 (fp32 on the CPU,
    through the torch paths: fp8 0.221 against 0.210, int4 1.19 against 1.15: this tiny
    random model's logits are fragile, the linears' rounding dominates)."""
    from flashpage import LLM, SamplingParams

    monkeypatch.delenv(ENV[method], raising=False)
    path = moe("qwen3_moe_gpu")
    prompts = random_prompts(12, 3, 300, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    base = LLM(str(path), dtype="bfloat16", num_gpu_blocks=1024)
    base_outs = base.generate(prompts, greedy, use_tqdm=False)
    base_lp = torch.tensor([lp.top[0][1] for o in base_outs for lp in o.outputs[0].logprobs])
    del base
    gc.collect()
    torch.cuda.empty_cache()
    kept = LLM(str(path), dtype="bfloat16", quantization=method, num_gpu_blocks=1024)
    layers = _experts(kept.engine.model)
    assert kept.engine.runner.graphs is not None
    assert layers and all(getattr(m, method) and m.fused_kernel for _, m in layers)
    kept_bytes = sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for _, m in layers)
    _, kept_lp = _forced(kept, prompts, base_outs)
    held = [(a.cpu(), b.cpu()) for a, b in _held_dequantized(kept.engine.model, torch.bfloat16)]
    monkeypatch.setenv(ENV[method], "dequant")
    twin = LLM(str(path), dtype="bfloat16", quantization=method, num_gpu_blocks=1024,
               enable_prefix_caching=False)  # its weights change between runs
    assert twin.engine.runner.graphs is not None
    twin_layers = _experts(twin.engine.model)
    assert kept_bytes * ratio == sum(m.gate_up_proj.nbytes + m.down_proj.nbytes
                                     for _, m in twin_layers)
    _, bf16_experts_lp = _forced(twin, prompts, base_outs)
    _overwrite_experts(twin.engine.model, held)
    twin_outs = twin.generate(prompts, greedy, use_tqdm=False)
    del twin
    gc.collect()
    torch.cuda.empty_cache()
    margins = torch.tensor([lp.top[0][1] - lp.top[1][1] for o in twin_outs
                            for lp in o.outputs[0].logprobs])
    ranks, _ = _forced(kept, prompts, twin_outs)
    assert torch.all(ranks[margins > 3.0] == 1)
    assert (ranks == 1).float().mean() > 0.45
    moved = (kept_lp - base_lp).abs().mean().item()
    moved_bf16_experts = (bf16_experts_lp - base_lp).abs().mean().item()
    assert moved <= 1.25 * moved_bf16_experts + 0.05, (moved, moved_bf16_experts)


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_inspect_counts_the_quantized_experts(moe, method, monkeypatch):
    """flashpage inspect --quantization, from config.json alone: the weights' bytes of the
    model the engine holds with the experts quantized (the switch at auto: as on CUDA, or
    kernel) and left 16-bit (dequant), each equal to the loaded model's; the report says
    which."""
    from flashpage.bench.common import weight_bytes
    from flashpage.config import ModelConfig
    from flashpage.inspect import format_report, inspect_config

    path = moe("qwen3_moe")
    cfg = ModelConfig.from_hf(path)
    flag = "fp8_moe_kernel" if method == "fp8" else "int4_moe_kernel"
    for env, keep in (("auto", True), ("kernel", True), ("dequant", False)):
        monkeypatch.setenv(ENV[method], env)
        model = _load(path, quantization=method, **{flag: keep})
        assert all(getattr(m, method) is keep for _, m in _experts(model))
        info = inspect_config(cfg, 1 << 30, "fp32", quantization=method)
        assert info["quantized_experts_kept"] is keep and info["quantized_expert_bytes"] > 0
        assert info["weights_bytes"] == weight_bytes(model), env
        report = format_report(info)
        assert ("quantized to " in report) is keep and (f"{method} experts)" in report) is keep
