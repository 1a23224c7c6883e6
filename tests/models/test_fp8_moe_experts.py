"""Block-fp8 routed experts kept in e4m3 (models/fp8_checkpoint.hold_fp8_experts,
layers/moe.FusedExperts.hold_fp8, kernels/fused_moe_fp8.py), on tiny random Qwen3-MoE,
DeepSeek-V3 and Qwen2-MoE checkpoints quantized here in 128 x 128 blocks (DeepSeek-V3's and
Qwen3-30B-A3B-FP8's form; hidden and expert intermediate sizes 128).

CPU: FLASHPAGE_FP8_MOE=kernel keeps them (auto keeps them only where the fused kernel runs:
CUDA), their values and tile scales the file's to the bit, nothing 16/32-bit of theirs
beside; the torch paths dequantize per call to the very weights of the dequantized twin,
so the engine's greedy tokens and log-probabilities equal the twin's and the dequant
path's to the bit. Experts that cannot keep fp8 (sizes not whole blocks) are dequantized.
GPU (marked gpu): bf16, engine defaults (auto: kept, the fused fp8 kernel under CUDA
graphs) against the bf16 engine over the dequantized twin, by the rule of
test_fp8_checkpoints' GPU test (W8A8 rounds the activations too)."""

from __future__ import annotations

import gc

import pytest
import torch

from flashpage.layers.moe import FusedExperts
from tests.conftest import build_tiny_mla_checkpoint, build_tiny_moe_checkpoint, random_prompts
from tests.models.test_fp8_checkpoints import build_fp8_checkpoint

GPU = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
WIDE = dict(hidden_size=128, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """name -> (fp8 folder, dequantized twin), built once: qwen3_moe (top-3 of 8, layer 0
    dense), deepseek_v3 (shared expert, a dense first layer), qwen2_moe (a gated shared
    expert of 48: not whole blocks, dequantized), qwen3_moe_narrow (experts of
    intermediate 64: not whole blocks), qwen3_moe_gpu (head_dim 32 for our CUDA kernels)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            if name == "deepseek_v3":
                src = build_tiny_mla_checkpoint(root / "src", "deepseek_v3", **WIDE,
                                                fan_in_init=True)
            elif name == "qwen3_moe_narrow":
                src = build_tiny_moe_checkpoint(root / "src", "qwen3_moe", hidden_size=128,
                                                moe_intermediate_size=64)
            elif name == "qwen2_moe":
                src = build_tiny_moe_checkpoint(root / "src", "qwen2_moe", **WIDE)
            elif name == "qwen3_moe_gpu":
                src = build_tiny_moe_checkpoint(root / "src", "qwen3_moe", head_dim=32, **WIDE)
            else:
                src = build_tiny_moe_checkpoint(root / "src", "qwen3_moe", **WIDE)
            build_fp8_checkpoint(src, root / "fp8", root / "ref", "fp8_block128")
            cache[name] = (root / "fp8", root / "ref")
        return cache[name]

    return get


def _experts(model) -> list[tuple[str, FusedExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedExperts)]


def _generate(path, prompts, **kw):
    from flashpage import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    kept = [n for n, m in _experts(llm.engine.model) if m.fp8]
    del llm
    gc.collect()
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.top[0][1] for lp in o.outputs[0].logprobs] for o in outs], kept)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_kept_experts_are_the_files_to_the_bit(fp8_moe, name, monkeypatch):
    """FLASHPAGE_FP8_MOE=kernel: every MoE layer's experts hold e4m3 [E, 2I, H] / [E, H, I]
    and fp32 tile scales, each expert's rows the file's gate / up / down values and
    weight_scale_inv tiles exactly; no 16/32-bit copy of them beside (the model's state
    is one byte per expert value plus the scales); dequantized_parameters gives them back
    dequantized, the twin's to the bit."""
    from safetensors.torch import load_file

    from flashpage.layers.quant import dequantized_parameters
    from flashpage.models.loader import load_model, resolve_model

    fp8, _ = fp8_moe(name)
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "kernel")
    model = load_model(resolve_model(str(fp8)), torch.float32, torch.device("cpu"),
                       fp8_moe_kernel=True)
    file = load_file(str(fp8 / "model.safetensors"))
    layers = _experts(model)
    assert layers and all(m.fp8 for _, m in layers)
    for path, m in layers:
        inter, e_count = m.intermediate, m.num_experts
        assert m.gate_up_proj.dtype == m.down_proj.dtype == FP8
        h = m.gate_up_proj.shape[2]
        assert m.gate_up_proj_scale.shape == (e_count, 2 * inter // 128, h // 128)
        assert m.down_proj_scale.shape == (e_count, h // 128, inter // 128)
        for e in range(e_count):
            p = f"{path}.{e}."
            want = torch.cat([file[p + "gate_proj.weight"], file[p + "up_proj.weight"]])
            assert torch.equal(m.gate_up_proj[e].view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(m.down_proj[e].view(torch.uint8),
                               file[p + "down_proj.weight"].view(torch.uint8))
            assert torch.equal(m.gate_up_proj_scale[e], torch.cat(
                [file[p + "gate_proj.weight_scale_inv"], file[p + "up_proj.weight_scale_inv"]]))
            assert torch.equal(m.down_proj_scale[e], file[p + "down_proj.weight_scale_inv"])
        own = {n: t for n, t in m.state_dict().items()}
        assert sorted(own) == ["down_proj", "down_proj_scale", "gate_up_proj", "gate_up_proj_scale"]
    # back in 32 bits (layers/quant.dequantized_parameters: hf_weights, benchmarks'
    # transformers baselines): the twin's parameters
    twin = load_model(resolve_model(str(fp8_moe(name)[1])), torch.float32, torch.device("cpu"))
    mine, ref = dict(dequantized_parameters(model)), dict(dequantized_parameters(twin))
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[n], ref[n]) for n in ref)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_engine_over_kept_experts_equals_the_dequantized_checkpoint(fp8_moe, name, monkeypatch):
    """fp32 on the CPU: experts kept in e4m3 (FLASHPAGE_FP8_MOE=kernel; the torch paths
    dequantize per call: scale * value in fp32, the twin's weights) give the same greedy
    tokens and log-probabilities, to the bit, as the engine over the dequantized twin and
    as FLASHPAGE_FP8_MOE=dequant over the same checkpoint; auto on the CPU keeps none (no
    fused kernel here)."""
    fp8, ref = fp8_moe(name)
    prompts = random_prompts(4, 3, 40, seed=7)
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "kernel")
    tokens, logprobs, kept = _generate(fp8, prompts)
    assert kept and len(kept) == len({k for k in kept})
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "dequant")
    deq_tokens, deq_logprobs, deq_kept = _generate(fp8, prompts)
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "auto")
    ref_tokens, ref_logprobs, ref_kept = _generate(ref, prompts)
    _, _, auto_kept = _generate(fp8, prompts[:1])
    assert deq_kept == ref_kept == auto_kept == []
    assert tokens == deq_tokens == ref_tokens
    assert logprobs == deq_logprobs == ref_logprobs


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_every_expert_path_over_kept_experts(fp8_moe, name):
    """Each FusedExperts path over kept e4m3 experts (fp32, CPU) against the dequantized
    twin's: gathered, every expert on every token and grouped (dequantized per call) equal
    to the bit; the fused kernel (Triton's interpreter: weight-only at these sizes) within
    fp32's accumulation order."""
    from flashpage.models.loader import load_model, resolve_model

    fp8, ref = fp8_moe(name)
    kept = _experts(load_model(resolve_model(str(fp8)), torch.float32, torch.device("cpu"),
                               fp8_moe_kernel=True))
    twin = _experts(load_model(resolve_model(str(ref)), torch.float32, torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    for (_, m), (_, r) in zip(kept, twin, strict=True):
        assert m.fp8 and not r.fp8
        for n in (1, 5):
            x = torch.randn(n, m.gate_up_proj.shape[2], generator=g)
            ids = torch.stack([torch.randperm(m.num_experts, generator=g)[:m.top_k]
                               for _ in range(n)])
            w = torch.rand(n, m.top_k, generator=g)
            for path in ("_gathered", "_all_experts"):
                assert torch.equal(getattr(m, path)(x, ids), getattr(r, path)(x, ids)), path
            assert torch.equal(m.forward_grouped(x, w, ids), r.forward_grouped(x, w, ids))
            want = r.forward_sync_free(x, w, ids)
            got = m.forward_fused(x, w, ids)
            assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_experts_not_whole_blocks_are_dequantized(fp8_moe, monkeypatch, caplog):
    """Experts of intermediate 64 (half a 128-block): dequantized with a warning naming the
    reason, even with FLASHPAGE_FP8_MOE=kernel; the tokens still equal the twin's."""
    fp8, ref = fp8_moe("qwen3_moe_narrow")
    prompts = random_prompts(2, 3, 20, seed=3)
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "kernel")
    with caplog.at_level("WARNING", logger="flashpage"):
        tokens, logprobs, kept = _generate(fp8, prompts)
    assert kept == []
    assert "routed experts dequantized" in caplog.text and "not a multiple of 128" in caplog.text
    ref_tokens, ref_logprobs, _ = _generate(ref, prompts)
    assert tokens == ref_tokens and logprobs == ref_logprobs


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_inspect_counts_the_experts_as_held(fp8_moe, name, monkeypatch):
    """flashpage inspect, from config.json alone: the weights' bytes the engine holds with
    the experts kept (a byte a value plus the tiles' scales) and with FLASHPAGE_FP8_MOE=dequant
    (in the model dtype), each equal to the loaded model's."""
    from flashpage.bench.common import weight_bytes
    from flashpage.config import ModelConfig
    from flashpage.inspect import inspect_config
    from flashpage.models.loader import load_model, resolve_model

    fp8, _ = fp8_moe(name)
    for env, keep in (("kernel", True), ("dequant", False)):
        monkeypatch.setenv("FLASHPAGE_FP8_MOE", env)
        model = load_model(resolve_model(str(fp8)), torch.float32, torch.device("cpu"),
                           fp8_moe_kernel=keep)
        info = inspect_config(ModelConfig.from_hf(fp8), 1 << 30, "fp32")
        assert info["fp8_experts_kept"] is keep and info["fp8_expert_bytes"] > 0
        assert info["weights_bytes"] == weight_bytes(model)


def test_fp8_moe_env_is_checked(monkeypatch):
    from flashpage import envs

    monkeypatch.setenv("FLASHPAGE_FP8_MOE", "keep")
    with pytest.raises(ValueError, match="FLASHPAGE_FP8_MOE must be auto, dequant or kernel"):
        envs.fp8_moe()
    monkeypatch.setenv("FLASHPAGE_FP8_MOE", " Dequant ")
    assert envs.fp8_moe() == "dequant"


# ----------------------------------------------------------------------------- GPU
def assert_kept_experts_follow_the_twin(kept_path, ref, flag: str, ratio: int) -> None:
    """bf16 on CUDA, engine defaults: each greedy token of the bf16 engine over the
    dequantized twin ``ref``, fed back, is the engine over ``kept_path``'s top token where
    bf16 is sure (margin > 3) and most of the time elsewhere; every MoE layer holds its
    experts quantized (``flag``: "fp8" / "int4") for the fused kernel, in 1 / ``ratio`` of
    the twin's bytes; decode graphs captured."""
    from flashpage import LLM, SamplingParams

    prompts = random_prompts(12, 3, 300, seed=2)
    base = LLM(str(ref), dtype="bfloat16", num_gpu_blocks=1024)
    outs = base.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 logprobs=2), use_tqdm=False)
    margins = torch.tensor([lp.top[0][1] - lp.top[1][1] for o in outs for lp in o.outputs[0].logprobs])
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
    base_bytes = sum(m.gate_up_proj.nbytes + m.down_proj.nbytes
                     for _, m in _experts(base.engine.model))
    del base
    gc.collect()
    torch.cuda.empty_cache()
    kept = LLM(str(kept_path), dtype="bfloat16", num_gpu_blocks=1024)
    layers = _experts(kept.engine.model)
    assert kept.engine.runner.graphs is not None
    assert layers and all(getattr(m, flag) and m.fused_kernel for _, m in layers)
    assert sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for _, m in layers) * ratio == base_bytes
    forced = kept.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = torch.tensor([e.rank for p, o in zip(prompts, forced, strict=True)
                          for e in o.prompt_logprobs[len(p):]])
    assert torch.all(ranks[margins > 3.0] == 1)
    assert (ranks == 1).float().mean() > 0.45


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_kept_fp8_experts_bf16_on_the_gpu_with_graphs(fp8_moe, monkeypatch):
    """bf16 on CUDA, engine defaults (auto: the experts kept e4m3 and run by the fused fp8
    kernel, decode graphs captured): each greedy token of the bf16 engine over the
    dequantized twin, fed back, is the kept engine's top token where bf16 is sure (margin
    > 3) and most of the time elsewhere; the experts take half the bytes of the twin's
    (FLASHPAGE_FP8_MOE=dequant holds them in bf16)."""

    monkeypatch.delenv("FLASHPAGE_FP8_MOE", raising=False)
    fp8, ref = fp8_moe("qwen3_moe_gpu")
    assert_kept_experts_follow_the_twin(fp8, ref, "fp8", 2)
