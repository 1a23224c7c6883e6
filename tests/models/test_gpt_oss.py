"""GPT-OSS (GptOssForCausalLM; models/gpt_oss.py, config._gpt_oss_fields): attention sinks,
alternating windowed and full layers, biases on q/k/v/o, YaRN rope, experts with biases and
a clamped SwiGLU over interleaved gate/up columns, MXFP4 expert checkpoints (models/mxfp4.py).

CPU, fp32: greedy tokens equal transformers' on every expert path (sync-free, grouped,
and the fused MoE kernel in the interpreter) over prompts past the window; the experts'
layout conversion (interleaved on disk, de-interleaved at load) and back; on our Triton kernels (interpreter: prefill and split decode
with sinks); through chunked prefill, preemption and prefix hits; the sinks, the window and
the activation's clamp each shown to change the tokens; YaRN's frequencies and attention
factor equal transformers' rope init (truncate false and true); MXFP4: our dequantization
equals transformers', and a checkpoint whose experts we quantize gives transformers' tokens
on the dequantized weights, dequantized at load and kept in MXFP4 (FLASHPAGE_MXFP4=kernel:
uint8 buffers, the MXFP4 fused kernel in the interpreter, the torch paths dequantizing per
call); weights back under HF's names; ``flashpage inspect``'s counts and weight bytes
(MXFP4 experts as held); config fields, defaults and errors.
GPU (marked gpu): bf16 on the Triton kernels and CUDA graphs follows fp32; MXFP4 experts
kept on CUDA give transformers' fp32 tokens, and in bf16 the dequantized path's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.moe import FusedExperts
from flashpage.layers.rotary import get_rope
from flashpage.models.gpt_oss import GptOssExperts
from flashpage.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.conftest import (
    _checkpoints,
    assert_staggered_matches_hf,
    count_expert_path,
    cpu_greedy,
    cpu_llm,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    tiny_table_builder,
    use_expert_path,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
WINDOW = 16
SLIDE, FULL = "sliding_attention", "full_attention"
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=32)
_BASE = dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
             intermediate_size=32, sliding_window=WINDOW, rope_parameters=YARN,
             swiglu_limit=1.5)
TINY: dict[str, tuple[str, dict]] = {
    # sliding, full, sliding (GptOssConfig's own alternation); head_dim 16, GQA 4 over 2;
    # a low swiglu_limit so that the clamps bind on these random weights
    "gpt_oss": ("GptOssConfig", dict(_BASE, num_hidden_layers=3, head_dim=16)),
    # head_dim 32 (our Triton kernels' smallest), 2 layers: full then sliding. The GPU tests
    # run it against the GPU image's transformers (5.17), whose experts ignore the config's
    # swiglu_limit / alpha (fixed at 7.0 / 1.702; read from the config since): the defaults
    "gpt_oss_d32": ("GptOssConfig", dict(_BASE, num_hidden_layers=2, head_dim=32,
                                         num_attention_heads=4, layer_types=[FULL, SLIDE],
                                         swiglu_limit=7.0)),
}
build = tiny_table_builder(TINY)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build)


def _widen_sinks(path: Path) -> None:
    """transformers initialises the sinks at N(0, 0.2) here: make them matter (some heads'
    sink well above their scores, so that most of the mass goes to it)."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name in t:
        if name.endswith("self_attn.sinks"):
            t[name] = torch.randn(t[name].shape, generator=g) * 2 + 1
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def ckpt(tiny_gpt_oss):
    path = tiny_gpt_oss("gpt_oss")
    if not (path / ".sinks").exists():
        _widen_sinks(path)
        (path / ".sinks").write_text("")
    return path


# up to 52 positions: past the window of 16
PROMPTS = random_prompts(3, 20, 40, seed=1)


@pytest.fixture(scope="module")
def expected(ckpt):
    """transformers' greedy tokens for PROMPTS (computed once for the tests below)."""
    return hf_greedy(ckpt, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("path", ["sync_free", "grouped", "fused"])
def test_greedy_matches_transformers(ckpt, expected, path, monkeypatch):
    """Each expert path for every token count: the torch ones, and the fused MoE kernel
    (biases, clamped SwiGLU at 1.5: the clamps bind) in the Triton interpreter."""
    llm = cpu_llm(ckpt)
    model = llm.engine.model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW, None, WINDOW]
    assert not any(m.fused_kernel for m in model.modules() if isinstance(m, GptOssExperts))
    use_expert_path(model, path)
    calls = count_expert_path(monkeypatch, path)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and min(calls) <= 3 and max(calls) >= 20  # decode steps and prompts
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_sinks_window_and_clamp_change_the_tokens(ckpt, expected, tmp_path):
    """Each feature matters on this checkpoint: without the sinks, with no window, or with
    the SwiGLU clamp lifted, our tokens part from the reference (so the test above could
    fail on each)."""
    from tests.conftest import edited_copy

    def no_sinks(t):
        for n in t:
            if n.endswith("sinks"):
                t[n] = torch.full_like(t[n], -1e4)

    variants = {
        "sinks": edited_copy(ckpt, tmp_path / "s", edit=no_sinks),
        "window": edited_copy(ckpt, tmp_path / "w", config_edit=lambda c: c.update(
            sliding_window=4096)),
        "clamp": edited_copy(ckpt, tmp_path / "c", config_edit=lambda c: c.update(
            swiglu_limit=1e4)),
    }
    for name, path in variants.items():
        assert cpu_greedy(path, PROMPTS) != expected, name


@pytest.mark.slow
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(ckpt):
    assert_staggered_matches_hf(ckpt, attention_backend="torch_native")


def test_triton_backend_in_the_interpreter(tiny_gpt_oss):
    """Our prefill and decode kernels (interpreted) with sinks, a window on layer 1, and key
    splits on the decodes (the CPU's small SM count splits them)."""
    path = tiny_gpt_oss("gpt_oss_d32")
    prompts = random_prompts(2, 18, 30, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = hf_greedy(path, prompts, params.max_tokens)
    assert cpu_greedy(path, prompts, params, attention_backend="triton") == expected


def test_weights_round_trip(ckpt):
    model, ref = load_and_round_trip(ckpt)
    assert model.model.layers[0].self_attn.sinks.dtype == torch.float32
    assert model.model.layers[0].mlp.router.weight.dtype == torch.float32
    attn = model.model.layers[0].self_attn
    assert attn.attn.sinks is attn.sinks  # the backend reads the loaded parameter


def test_expert_layout_conversion():
    """transformers' interleaved [E, H, 2I] gate/up (even columns gate) -> our [E, 2I, H]
    gate rows then up rows (the bias likewise), down transposed; and back exactly."""
    from flashpage.models.gpt_oss import experts_from_hf, experts_to_hf

    e, h, inter = 2, 3, 4
    w = torch.arange(e * h * 2 * inter, dtype=torch.float32).view(e, h, 2 * inter)
    ours = experts_from_hf("model.layers.0.mlp.experts.gate_up_proj", w)
    assert ours.shape == (e, 2 * inter, h)
    assert torch.equal(ours[:, :inter], w[..., 0::2].transpose(1, 2))
    assert torch.equal(ours[:, inter:], w[..., 1::2].transpose(1, 2))
    b = torch.arange(e * 2 * inter, dtype=torch.float32).view(e, 2 * inter)
    ob = experts_from_hf("experts.gate_up_proj_bias", b)
    assert torch.equal(ob, torch.cat([b[:, 0::2], b[:, 1::2]], 1))
    d = torch.randn(e, inter, h)
    assert torch.equal(experts_from_hf("x.experts.down_proj", d), d.transpose(1, 2))
    for name, t in (("a.experts.gate_up_proj", w), ("a.experts.gate_up_proj_bias", b),
                    ("a.experts.down_proj", d), ("a.experts.down_proj_bias", b)):
        assert torch.equal(experts_to_hf(name, experts_from_hf(name, t)), t), name
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        experts_from_hf("m.experts.gate_up_proj", torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="experts.down_proj"):
        experts_from_hf("m.experts.down_proj", torch.zeros(2, 3))


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_block_paths_match_transformers_module(tokens):
    """Our router and experts against transformers' GptOssMLP (fp32, its weights loaded by
    name through experts_from_hf): the gathered path (3 * tokens * k <= experts), every
    expert on every token, the fused MoE kernel (interpreted) and the grouped path give its
    output."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as HFMLP

    from flashpage.models.gpt_oss import GptOssMLP, experts_from_hf

    d = _hf_dict("gpt_oss", num_local_experts=16)
    hf = HFMLP(transformers.GptOssConfig(**{k: v for k, v in d.items() if k != "architectures"}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    ours = GptOssMLP(ModelConfig.from_hf(d))
    ours.load_state_dict({n: experts_from_hf(n, t) for n, t in hf.state_dict().items()})
    x = torch.randn(tokens, 64, generator=g)
    with torch.no_grad():
        want = hf(x[None])[0][0]
        calls = []
        for name in ("_gathered", "_all_experts"):
            fn = getattr(ours.experts, name)
            setattr(ours.experts, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
        got = ours(x)
        ours.experts.fused_kernel = True  # the fused MoE kernel, interpreted
        fused = ours(x)
        ours.experts.sync_free_max_tokens = -1
        grouped = ours(x)
    assert calls == ["_gathered" if 3 * tokens * 2 <= 16 else "_all_experts"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped, want, atol=1e-5, rtol=1e-5)
    # every path above ran the clamps: some gate/up values pass the limit of 1.5
    h = x @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
    assert (h.abs() > 1.5).any()


# ----------------------------------------------------------------- YaRN
@pytest.mark.parametrize("rope", [
    YARN,
    dict(YARN, truncate=True),
    dict(rope_type="yarn", rope_theta=150_000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
         truncate=False, original_max_position_embeddings=4096),  # the released models'
    dict(YARN, attention_factor=0.8),
])
def test_yarn_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.GptOssConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    d = hf.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    cfg = ModelConfig.from_hf(d)
    rotary = get_rope(cfg, 64)
    torch.testing.assert_close(rotary.inv_freq, inv_freq, rtol=0, atol=0)
    assert rotary.mscale == pytest.approx(factor, rel=1e-12)
    # the cache holds cos and sin times the factor
    t = torch.arange(64, dtype=torch.float)[:, None] * inv_freq
    torch.testing.assert_close(rotary.cos_sin_cache, torch.cat([t.cos(), t.sin()], -1) * factor)


def test_truncate_changes_the_frequencies():
    base = ModelConfig.from_hf({**_hf_dict("gpt_oss"), "rope_parameters": YARN})
    other = ModelConfig.from_hf({**_hf_dict("gpt_oss"), "rope_parameters": dict(YARN, truncate=True)})
    assert not torch.equal(get_rope(base, 64).inv_freq, get_rope(other, 64).inv_freq)


# ----------------------------------------------------------------- MXFP4
def test_dequantize_matches_transformers():
    """Our MXFP4 reading against transformers' (integrations/mxfp4.py) on random bytes: the
    nibble order, the value table, the e8m0 scales and the [E, out, in] -> [E, in, out]
    transpose of its experts."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from flashpage.models.mxfp4 import mxfp4_weights

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 136, (3, 24, 4), dtype=torch.uint8, generator=g)
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 24]
    (name, ours), = list(mxfp4_weights([("x.gate_up_proj_blocks", blocks),
                                        ("x.gate_up_proj_scales", scales)], torch.float32, True))
    assert name == "x.gate_up_proj"
    assert torch.equal(ours, hf)
    # and the quantizer writes what the reader reads back: e2m1-representable values exactly
    w = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w)), w)


def test_mxfp4_errors():
    from flashpage.models.mxfp4 import mxfp4_weights

    b = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    s = torch.zeros(2, 4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="quantization_config"):
        list(mxfp4_weights([("a.down_proj_blocks", b)], torch.float32, False))
    with pytest.raises(ValueError, match="other half"):
        list(mxfp4_weights([("a.down_proj_blocks", b)], torch.float32, True))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(b, s[..., :0])


def _mxfp4_copies(src: Path, dst: Path) -> tuple[Path, Path]:
    """The checkpoint at ``src`` with its experts quantized to MXFP4 (our quantizer,
    transformers' layout and names, quantization_config mxfp4) -> (that folder, a folder of
    the same weights dequantized: a plain checkpoint transformers reads), under ``dst``."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(src / "model.safetensors"))
    packed, plain = {}, {}
    for name, w in t.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(w.transpose(1, 2))  # along the input dim
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            plain[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
            assert not torch.equal(plain[name], w)  # the quantization changed the weights
        else:
            packed[name] = plain[name] = w
    cfg = json.loads((src / "config.json").read_text())
    for folder, tensors, extra in (("mx", packed, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}),
                                   ("deq", plain, {})):
        (dst / folder).mkdir()
        save_file(tensors, str(dst / folder / "model.safetensors"), metadata={"format": "pt"})
        (dst / folder / "config.json").write_text(json.dumps({**cfg, **extra}))
    return dst / "mx", dst / "deq"


@pytest.fixture(scope="module")
def mxfp4_ckpt(ckpt, tmp_path_factory):
    """The tiny model's MXFP4 copies (_mxfp4_copies) -> (MXFP4 folder, dequantized folder,
    the prompts, transformers' tokens on the dequantized weights)."""
    mx, deq = _mxfp4_copies(ckpt, tmp_path_factory.mktemp("mxfp4"))
    prompts = random_prompts(3, 10, 30, seed=4)
    expected = hf_greedy(deq, prompts, GREEDY.max_tokens)
    assert expected != hf_greedy(ckpt, prompts, GREEDY.max_tokens)  # quantized: other tokens
    return mx, deq, prompts, expected


def test_mxfp4_checkpoint_matches_transformers(mxfp4_ckpt, tmp_path, monkeypatch):
    """Dequantized at load (the CPU's default; FLASHPAGE_MXFP4=dequant anywhere): our
    tokens from the MXFP4 checkpoint equal transformers' on the same weights dequantized."""
    from safetensors.torch import load_file, save_file

    mx, deq, prompts, expected = mxfp4_ckpt
    assert ModelConfig.from_hf(mx).mxfp4_experts
    monkeypatch.setenv("FLASHPAGE_MXFP4", "dequant")
    llm = cpu_llm(mx)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert not experts.mxfp4 and experts.gate_up_proj.dtype == torch.float32
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    monkeypatch.delenv("FLASHPAGE_MXFP4")
    assert not cpu_llm(mx).engine.model.model.layers[0].mlp.experts.mxfp4  # auto, on the CPU
    # an MXFP4 tensor in a checkpoint whose config does not say so
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((deq / "config.json").read_text())
    save_file(load_file(str(mx / "model.safetensors")), str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="MXFP4"):
        cpu_llm(bad)


def _mxfp4_expert_bytes(model) -> tuple[int, int]:
    """(bytes of the experts' MXFP4 buffers, bytes of any 16-bit expert weights)."""
    held = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
               if n.endswith(("proj_blocks", "proj_scales")))
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    return held, dense


@pytest.mark.parametrize("path", ["fused", "sync_free", "grouped"])
def test_mxfp4_kept_matches_transformers(mxfp4_ckpt, path, monkeypatch):
    """FLASHPAGE_MXFP4=kernel: the experts stay MXFP4 (uint8 blocks and scales, 4.25 bits a
    weight, no 16-bit copy) and give transformers' tokens on every expert path: the fused
    MXFP4 kernel in the interpreter, and the torch paths dequantizing per call."""
    mx, _, prompts, expected = mxfp4_ckpt
    monkeypatch.setenv("FLASHPAGE_MXFP4", "kernel")
    llm = cpu_llm(mx)
    model = llm.engine.model
    layers = model.model.layers
    ex = layers[0].mlp.experts
    assert ex.mxfp4 and ex.gate_up_proj is None and ex.down_proj is None
    assert ex.gate_up_proj_blocks.dtype == ex.down_proj_scales.dtype == torch.uint8
    e, inter, hidden = 8, 32, 64
    held, dense = _mxfp4_expert_bytes(model)
    assert dense == 0
    # per layer: E * (2I * H + H * I) weights, half a byte each plus a byte per 32
    assert held == len(layers) * e * (2 * inter * hidden + hidden * inter) * 17 // 32
    use_expert_path(model, path)
    calls = count_expert_path(monkeypatch, path)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and min(calls) <= 3 and max(calls) >= 10


def test_mxfp4_kept_prompts_past_the_sync_free_size_run_the_fused_kernel(mxfp4_ckpt,
                                                                          monkeypatch):
    """Kept MXFP4 experts with the fused kernel on: a step of more tokens than the sync-free
    size runs the fused kernel too, not the grouped path (which dequantizes every used
    expert at each call), and gives transformers' tokens."""
    mx, _, prompts, expected = mxfp4_ckpt
    monkeypatch.setenv("FLASHPAGE_MXFP4", "kernel")
    llm = cpu_llm(mx)
    use_expert_path(llm.engine.model, "fused")
    for m in llm.engine.model.modules():
        if isinstance(m, FusedExperts):
            m.sync_free_max_tokens = 3  # every prompt step is past it
    fused = count_expert_path(monkeypatch, "fused")
    grouped = count_expert_path(monkeypatch, "grouped")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert not grouped and max(fused) > 3


def test_mxfp4_kept_weights_back_under_hf_names(mxfp4_ckpt, monkeypatch):
    """hf_weights of a model holding MXFP4 experts: every tensor under its HF name, the
    experts dequantized in transformers' layout, equal to the dequantized checkpoint's."""
    from flashpage.models.loader import iter_safetensors, load_model, resolve_model

    mx, deq, _, _ = mxfp4_ckpt
    model = load_model(resolve_model(str(mx)), torch.float32, torch.device("cpu"),
                       mxfp4_kernel=True)
    assert model.model.layers[0].mlp.experts.mxfp4
    ref = dict(iter_safetensors(str(deq)))
    mine = dict(model.hf_weights())
    assert mine.keys() == ref.keys()
    for n in ref:
        assert torch.equal(mine[n], ref[n]), n


def test_mxfp4_kept_random_weights(ckpt, tmp_path):
    """Random weights (benchmarks: a config with quantization_config mxfp4, e.g. through
    hf_overrides) held in MXFP4: random e2m1 bytes at scale 2 ** -7 (weights of RMS ~0.02,
    as the 16-bit random init), and a forward of them runs."""
    from flashpage.models.loader import load_model, resolve_model

    cfg = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    model = load_model(resolve_model(None, str(tmp_path / "config.json")), torch.float32,
                       torch.device("cpu"), mxfp4_kernel=True)
    ex = model.model.layers[0].mlp.experts
    assert ex.mxfp4 and (ex.down_proj_scales == 127 - 7).all()
    assert ex.gate_up_proj_blocks.unique().numel() > 200  # random bytes, not zeros
    w = ex._weight("gate_up_proj", torch.float32)
    assert 0.015 < w.pow(2).mean().sqrt().item() < 0.03
    x = torch.randn(5, 64)
    weights, ids = model.model.layers[0].mlp.router(x)
    assert torch.isfinite(ex(x, weights, ids)).all()


def test_mxfp4_kept_load_errors(mxfp4_ckpt, tmp_path, monkeypatch):
    """A 16-bit expert weight, or MXFP4 blocks of the wrong shape, in a checkpoint whose
    experts are held in MXFP4: a ValueError naming the tensor; FLASHPAGE_MXFP4 checked."""
    from safetensors.torch import load_file, save_file

    mx, deq, _, _ = mxfp4_ckpt
    monkeypatch.setenv("FLASHPAGE_MXFP4", "kernel")
    cfg = (mx / "config.json").read_text()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for folder, edit, match in (
            ("dense", lambda t: t.update({name: load_file(str(deq / "model.safetensors"))[name]}),
             "16-bit expert weight"),
            ("shape", lambda t: t.update({name + "_blocks": t[name + "_blocks"][:, :-2].contiguous()}),
             "does not fit")):
        t = load_file(str(mx / "model.safetensors"))
        edit(t)
        (tmp_path / folder).mkdir()
        save_file(t, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(cfg)
        with pytest.raises(ValueError, match=match):
            cpu_llm(tmp_path / folder)
    monkeypatch.setenv("FLASHPAGE_MXFP4", "fp4")
    with pytest.raises(ValueError, match="FLASHPAGE_MXFP4"):
        cpu_llm(mx)


# ----------------------------------------------------------------- config
def _hf_dict(name: str, **kw) -> dict:
    cls, extra = TINY[name]
    base = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=512)
    d = getattr(transformers, cls)(**{**base, **extra, **kw}).to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    return d


def test_config_fields_and_defaults():
    cfg = ModelConfig.from_hf(_hf_dict("gpt_oss"))
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    assert cfg.layer_types == (SLIDE, FULL, SLIDE) and cfg.sliding_window == WINDOW
    assert [cfg.attention_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    assert not cfg.rope_scaling.truncate and cfg.rope_theta == 10_000.0
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 1.5)
    assert not cfg.mxfp4_experts and cfg.quantization_config is None
    # the released config.json's shape: rope_scaling beside rope_theta, and GptOssConfig's
    # defaults where fields are absent
    bare = ModelConfig.from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
                                "num_attention_heads": 16})
    assert bare.num_key_value_heads == 8  # GptOssConfig's, not num_attention_heads
    assert bare.head_dim == 64 and bare.sliding_window == 128 and bare.rms_norm_eps == 1e-5
    assert bare.layer_types == (SLIDE, FULL, SLIDE, FULL)
    assert (bare.n_routed_experts, bare.num_experts_per_tok) == (128, 4)
    assert bare.rope_theta == 150_000.0 and bare.rope_scaling is not None
    assert (bare.rope_scaling.factor, bare.rope_scaling.original_max_position_embeddings) == (32.0, 4096)
    assert not bare.rope_scaling.truncate and bare.swiglu_limit == 7.0
    released = ModelConfig.from_hf({**_hf_dict("gpt_oss"), "rope_parameters": None,
                                    "rope_theta": 150000, "rope_scaling": dict(
                                        YARN, original_max_position_embeddings=4096)})
    assert released.rope_theta == 150_000.0 and released.rope_scaling.original_max_position_embeddings == 4096


@pytest.mark.parametrize("edit, match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_local_experts=0), "num_local_experts"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)),
     "original_max_position_embeddings"),
    (dict(rope_parameters=dict(YARN, truncate="no")), "truncate"),
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(rope_parameters=dict(YARN, rope_type="dynamic")), "rope_scaling type"),
])
def test_config_errors(edit, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**_hf_dict("gpt_oss"), **edit})


def test_inspect_counts_parameters_and_kv():
    """``flashpage inspect``'s parameter count is transformers' (sinks, biases, router bias
    counted); its KV figures: a request's KV has no bound (the full layer keeps every
    token), past the window only the full layer's bytes grow (KV cache groups: the windowed
    layers' blocks behind the window go back, kv_cache/hybrid.py)."""
    from flashpage.inspect import inspect_config, param_counts

    d = _hf_dict("gpt_oss")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**{
        k: v for k, v in d.items() if k != "architectures"}))
    cfg = ModelConfig.from_hf(d)
    total, active = param_counts(cfg)
    assert total == hf.num_parameters()
    e = hf.model.layers[0].mlp.experts
    per_expert = (e.gate_up_proj[0].numel() + e.gate_up_proj_bias[0].numel()
                  + e.down_proj[0].numel() + e.down_proj_bias[0].numel())
    assert total - active == 3 * (8 - 2) * per_expert
    info = inspect_config(cfg, 1 << 30)
    assert info["sliding_window_layers"] == 2 and info["kv_bytes_per_request_max"] is None
    assert info["kv_values_per_token_per_layer"] == 2 * 2 * 16
    assert info["attention_sinks"] is True
    groups = info["kv_groups"]  # 1 full + 2 windowed layers, one layer a group
    assert (groups["full_groups"], groups["windowed_groups"], groups["window"]) == (1, 2, WINDOW)
    assert groups["kv_bytes_per_token_past_window"] == info["kv_bytes_per_token_per_layer"]


def test_inspect_weights_bytes_with_mxfp4_experts(monkeypatch):
    """gpt-oss-20b's config with its checkpoint's quantization_config: ``flashpage inspect``
    counts the experts as held, 4.25 bits a weight (~12.8 GiB of weights in all, against
    ~39 GiB with FLASHPAGE_MXFP4=dequant), and says which; auto is the default."""
    from flashpage.inspect import format_report, inspect_config, param_counts

    monkeypatch.delenv("FLASHPAGE_MXFP4", raising=False)

    d = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "gpt-oss-20b"
                    / "config.json").read_text())
    cfg = ModelConfig.from_hf({**d, "quantization_config": {"quant_method": "mxfp4"}})
    total, _ = param_counts(cfg)
    experts = 24 * 32 * 3 * 2880 * 2880  # layers * E * (2I * H + H * I)
    info = inspect_config(cfg, 80 << 30, "bfloat16")
    assert info["mxfp4_kept"] and info["mxfp4_expert_bytes"] == experts * 17 // 32
    assert info["mxfp4_expert_bytes_dequantized"] == experts * 2
    assert info["weights_bytes"] == (total - experts) * 2 + experts * 17 // 32
    assert 12.5 < info["weights_bytes"] / 2**30 < 13.5
    assert "MXFP4 experts" in format_report(info) and "kept so" in format_report(info)
    monkeypatch.setenv("FLASHPAGE_MXFP4", "dequant")
    info = inspect_config(cfg, 80 << 30, "bfloat16")
    assert not info["mxfp4_kept"] and info["weights_bytes"] == total * 2
    assert "dequantized to" in format_report(info)
    plain = inspect_config(ModelConfig.from_hf(d), 80 << 30, "bfloat16")
    assert plain["weights_bytes"] == total * 2 and plain["mxfp4_expert_bytes"] == 0


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_fp32_and_bf16(tiny_gpt_oss):
    from tests.conftest import assert_gpu_graphs_match_hf, bf16_teacher_forced_hits

    path = tiny_gpt_oss("gpt_oss_d32")
    prompts = random_prompts(4, 10, 60, seed=5)
    assert_gpu_graphs_match_hf(path, prompts)
    truth = hf_greedy(path, prompts, 12)
    ours, theirs = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton",
                                            block_size=16)
    total = sum(len(t) for t in truth)
    assert ours >= theirs - 0.03 * total and ours >= 0.85 * total, (ours, theirs, total)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mxfp4_experts_kept(tiny_gpt_oss, tmp_path, monkeypatch):
    """An MXFP4 checkpoint on CUDA with the triton backend: its experts stay MXFP4 (the
    default) and run the MXFP4 fused kernel; fp32 with CUDA graphs and eagerly gives
    transformers' tokens on the dequantized weights; bf16 gives the tokens of the same
    model with FLASHPAGE_MXFP4=dequant (the kernel's rounding is the dequantized path's)."""
    from flashpage import LLM
    from tests.conftest import assert_gpu_graphs_match_hf

    mx, deq = _mxfp4_copies(tiny_gpt_oss("gpt_oss_d32"), tmp_path)
    prompts = random_prompts(4, 10, 60, seed=5)
    llm = assert_gpu_graphs_match_hf(mx, prompts,
                                     reference=lambda _p, pr, n: hf_greedy(deq, pr, n))
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.mxfp4 and experts.fused_kernel
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.gate_up_proj is None

    def bf16_tokens():
        out = LLM(str(mx), dtype="bfloat16", device="cuda", attention_backend="triton",
                  block_size=16)
        assert out.engine.model.model.layers[0].mlp.experts.mxfp4 == (
            os.environ.get("FLASHPAGE_MXFP4") != "dequant")
        return [o.outputs[0].token_ids for o in out.generate(prompts, GREEDY, use_tqdm=False)]

    kept = bf16_tokens()
    monkeypatch.setenv("FLASHPAGE_MXFP4", "dequant")
    assert kept == bf16_tokens()


def test_yarn_on_a_llama_matches_transformers(tmp_path):
    """YaRN on ordinary rotary attention is not GPT-OSS's alone: a Llama whose config names
    it (truncate left at transformers' default, true) gives transformers' tokens."""
    from tests.conftest import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path, "llama31_gqa", rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16), rope_theta=10_000.0)
    cfg = ModelConfig.from_hf(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    assert cfg.rope_scaling.truncate
    prompts = random_prompts(2, 20, 40, seed=6)
    assert cpu_greedy(path, prompts) == hf_greedy(path, prompts, GREEDY.max_tokens)
