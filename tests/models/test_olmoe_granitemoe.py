"""OLMoE (OLMo2's whole-width q/k norms, clip_qkv, SparseMoeBlock with norm_topk_prob as
configured) and Granite MoE / GraniteMoeShared (Granite's multipliers, fused on-disk experts
under their own names, renormalized top-k, a shared MLP): models/olmoe.py, granite.py.

CPU, fp32: greedy tokens equal transformers' on each expert path (sync-free, grouped, the
fused Triton kernel and router in the interpreter); clip_qkv really clamps; prompt logprobs
equal transformers' log-softmax (Granite's logits scaling); chunked prefill, preemption and
prefix hits (OLMoE); the MoE blocks and routers against transformers' own modules; the checkpoint
names in and back out; no host sync up to 512 tokens (CUDA graphs); ``flashpage inspect``'s
counts (OLMoE-1B-7B's published 6.9B / 1.3B active) and weight bytes, fp8 too; config
fields and errors.
GPU (marked gpu): CUDA graphs and the fused kernels in fp32 give transformers' tokens, and
bf16 follows fp32 about as far as transformers' bf16 does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import format_report, inspect_config, param_counts
from flashpage.layers.moe import SparseMoeBlock
from flashpage.models.granite import GraniteMoeBlock
from flashpage.models.loader import ModelLoadError, iter_safetensors, load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    count_expert_path,
    cpu_llm,
    edited_copy,
    hf_greedy,
    random_prompts,
    tiny_table_builder,
    use_expert_path,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CLIP = 2.0  # olmoe's clip_qkv: the normed q / k and v pass it often at these weights
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.09,
               logits_scaling=8.0)
_BASE = dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=32)
# name -> (HF config class name, extra config kwargs); 2 layers, hidden 64, 4 heads of 16
TINY: dict[str, tuple[str, dict]] = {
    # top-2 of 8 not renormalized (OLMoE's default), q/k/v clamped to +-2
    "olmoe": ("OlmoeConfig", dict(_BASE, num_experts=8, num_experts_per_tok=2, clip_qkv=CLIP)),
    # top-3 renormalized, biased q/k/v/o, no clamp
    "olmoe_norm": ("OlmoeConfig", dict(_BASE, num_experts=8, num_experts_per_tok=3,
                                       norm_topk_prob=True, attention_bias=True)),
    # Granite 3.0 1B-A400M's shape: multipliers, tied head, top-2 of 8 experts
    "granitemoe": ("GraniteMoeConfig", dict(_BASE, **GRANITE, num_local_experts=8,
                                            num_experts_per_tok=2, tie_word_embeddings=True)),
    # a shared MLP of 48 beside top-3 of 6 experts, untied head
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(
        _BASE, **GRANITE, num_local_experts=6, num_experts_per_tok=3,
        shared_intermediate_size=48)),
}
NAMES = sorted(TINY)
ARCH = {"OlmoeConfig": "OlmoeForCausalLM", "GraniteMoeConfig": "GraniteMoeForCausalLM",
        "GraniteMoeSharedConfig": "GraniteMoeSharedForCausalLM"}
# Triton runs on the GPU where there is one, else in its interpreter (tests/conftest.py).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


build_tiny = tiny_table_builder(TINY)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _tokens(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ----------------------------------------------------------------- against transformers
@pytest.mark.parametrize("path", ["sync_free", "grouped"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name, path, monkeypatch):
    ckpt = tiny(name)
    prompts = random_prompts(3, 5, 40, seed=1)
    expected = hf_greedy(ckpt, prompts, GREEDY.max_tokens)
    llm = cpu_llm(ckpt)
    blocks = [layer.mlp for layer in llm.engine.model.model.layers]
    assert all(isinstance(b, GraniteMoeBlock if name.startswith("granite") else SparseMoeBlock)
               for b in blocks)
    if name == "granitemoeshared":
        assert all(b.shared_mlp is not None for b in blocks)
    use_expert_path(llm.engine.model, path)
    calls = count_expert_path(monkeypatch, path)
    assert _tokens(llm, prompts) == expected
    assert calls and min(calls) <= 3 and max(calls) > 5  # decode steps and prompts took this path
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_greedy_matches_transformers_on_the_fused_kernel(tiny, monkeypatch):
    """kernels/fused_moe.py and kernels/moe_router.py (renormalizing, top-3 of 6, beside the
    shared MLP), in the Triton interpreter on the CPU (OLMoE's router without the
    renormalization: test_router_matches_hf, test_moe_block_matches_hf)."""
    ckpt = tiny("granitemoeshared")
    prompts = random_prompts(2, 5, 30, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = hf_greedy(ckpt, prompts, params.max_tokens)
    llm = cpu_llm(ckpt, device=DEV)
    use_expert_path(llm.engine.model, "fused")
    calls = count_expert_path(monkeypatch, "fused")
    assert _tokens(llm, prompts, params) == expected
    assert calls and min(calls) <= 2 and max(calls) > 5


def test_clip_qkv_clamps(tiny, tmp_path):
    """The clamp is applied (the tokens above equal transformers' with it) and binds: the
    same weights without it give other tokens, ours and transformers' alike."""
    ckpt = tiny("olmoe")
    assert ModelConfig.from_hf(ckpt).clip_qkv == CLIP
    unclipped = edited_copy(ckpt, tmp_path / "unclipped", config_edit=lambda c: c.update(clip_qkv=None))
    prompts = random_prompts(2, 5, 40, seed=1)
    got = _tokens(cpu_llm(unclipped), prompts)
    assert got == hf_greedy(unclipped, prompts, GREEDY.max_tokens)
    assert got != hf_greedy(ckpt, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("name", ["olmoe", "granitemoe"])
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves (Granite's logits_scaling shows here alone): each prompt
    token's logprob is transformers' log-softmax."""
    path = tiny(name)
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = cpu_llm(path).generate([prompt], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    want = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens
    (OLMoE's clamped attention over chunks; Granite MoE's attention is dense Granite's,
    checked so in test_more_families.py, and an MoE block sees tokens, not chunks)."""
    assert_staggered_matches_hf(tiny("olmoe"), attention_backend="torch_native")


# ----------------------------------------------------------------- against HF's modules
def _hf_block(kind: str, seed: int, **kw) -> tuple[torch.nn.Module, ModelConfig]:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=3)
    if kind == "granitemoe":
        conf = transformers.GraniteMoeConfig(**common, num_local_experts=8,
                                             residual_multiplier=0.5, **kw)
        hf = GraniteMoeMoE(conf)
    else:
        conf = transformers.OlmoeConfig(**common, num_experts=8, **kw)
        hf = OlmoeSparseMoeBlock(conf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return hf.eval(), ModelConfig.from_hf(conf.to_dict())


BLOCK_CASES = [("olmoe", dict(norm_topk_prob=False)), ("olmoe", dict(norm_topk_prob=True)),
               ("granitemoe", {})]
BLOCK_IDS = ["olmoe_plain", "olmoe_norm", "granitemoe"]


def _ours(kind: str, cfg: ModelConfig, hf: torch.nn.Module) -> torch.nn.Module:
    ours = GraniteMoeBlock(cfg) if kind == "granitemoe" else SparseMoeBlock(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)  # transformers 5's in-memory names
    return ours


@pytest.mark.parametrize("path", ["sync_free", "grouped", "fused"])
@pytest.mark.parametrize(("kind", "kw"), BLOCK_CASES, ids=BLOCK_IDS)
def test_moe_block_matches_hf(kind, kw, path):
    """Granite's block times residual_multiplier (HF's layer applies it after the block)."""
    hf, cfg = _hf_block(kind, seed=3, **kw)
    ours = _ours(kind, cfg, hf).to(DEV)
    use_expert_path(ours, path)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(x) * cfg.residual_multiplier
        got = ours(x.to(DEV)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize(("kind", "kw"), BLOCK_CASES, ids=BLOCK_IDS)
def test_router_matches_hf(kind, kw, fused):
    """MoEGate (torch, or kernels/moe_router.py) against transformers' router: the same
    experts and weights; summed to 1 where the family renormalizes (Granite's softmax over
    the k best logits is the top-k softmax renormalized)."""
    hf, cfg = _hf_block(kind, seed=5, **kw)
    ours = _ours(kind, cfg, hf)
    gate = (ours.router if kind == "granitemoe" else ours.gate).to(DEV)
    gate.fused_route = fused
    x = torch.randn(33, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, want_w, want_ids = (hf.router if kind == "granitemoe" else hf.gate)(x)
        got_w, got_ids = (t.cpu() for t in gate(x.to(DEV)))
    want_order, got_order = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(got_order.values, want_order.values)
    torch.testing.assert_close(got_w.gather(1, got_order.indices),
                               want_w.float().gather(1, want_order.indices), rtol=1e-5, atol=1e-6)
    sums = got_w.sum(-1)
    if kind == "granitemoe" or kw["norm_topk_prob"]:
        assert cfg.norm_topk_prob
        torch.testing.assert_close(sums, torch.ones(33))
    else:
        assert (sums < 1 - 1e-3).all()  # 3 of 8 softmax scores: not renormalized


# ----------------------------------------------------------------- loading
def test_granite_checkpoint_names_load_and_come_back(tiny, tmp_path):
    ckpt = tiny("granitemoeshared")
    ref = dict(iter_safetensors(str(ckpt)))
    p = "model.layers.1"
    assert ref[f"{p}.block_sparse_moe.input_linear.weight"].shape == (6, 64, 64)  # [E, 2I, H]
    model = load_model(resolve_model(str(ckpt)), torch.float32, torch.device("cpu"))
    moe = model.model.layers[1].mlp
    assert torch.equal(moe.experts.gate_up_proj, ref[f"{p}.block_sparse_moe.input_linear.weight"])
    assert torch.equal(moe.experts.down_proj, ref[f"{p}.block_sparse_moe.output_linear.weight"])
    assert torch.equal(moe.router.weight, ref[f"{p}.block_sparse_moe.router.layer.weight"])
    assert torch.equal(moe.shared_mlp.gate_up_proj.weight, ref[f"{p}.shared_mlp.input_linear.weight"])
    assert torch.equal(moe.shared_mlp.down_proj.weight, ref[f"{p}.shared_mlp.output_linear.weight"])
    mine = dict(model.hf_weights())
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[n], ref[n]) for n in ref)

    missing = edited_copy(ckpt, tmp_path / "missing",
                          lambda t: t.pop(f"{p}.block_sparse_moe.output_linear.weight"))
    # named as the checkpoint names it (hf_names), the tensor the user would look for
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.block_sparse_moe\.output_linear\.weight"):
        load_model(resolve_model(str(missing)), torch.float32, torch.device("cpu"))
    wrong = edited_copy(ckpt, tmp_path / "wrong", lambda t: t.update(
        {f"{p}.shared_mlp.input_linear.weight": torch.zeros(90, 64)}))
    with pytest.raises(ValueError, match=r"shared_mlp\.input_linear\.weight: checkpoint shape "
                                         r"\(90, 64\) != \(96, 64\)"):
        load_model(resolve_model(str(wrong)), torch.float32, torch.device("cpu"))


def test_olmoe_experts_load_fused_and_norms_whole_width(tiny):
    ckpt = tiny("olmoe")
    ref = dict(iter_safetensors(str(ckpt)))
    p = "model.layers.0"
    assert f"{p}.mlp.experts.7.up_proj.weight" in ref  # one tensor per expert on disk
    model = load_model(resolve_model(str(ckpt)), torch.float32, torch.device("cpu"))
    layer = model.model.layers[0]
    assert torch.equal(layer.mlp.experts.gate_up_proj[7, 32:], ref[f"{p}.mlp.experts.7.up_proj.weight"])
    assert torch.equal(layer.mlp.experts.down_proj[3], ref[f"{p}.mlp.experts.3.down_proj.weight"])
    assert layer.self_attn.q_norm.weight.shape == (64,) and layer.self_attn.k_norm.weight.shape == (32,)
    mine = dict(model.hf_weights())
    for name in (f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_proj.weight", f"{p}.mlp.gate.weight"):
        assert torch.equal(mine[name], ref[name]), name
    assert mine[f"{p}.mlp.experts.down_proj"].shape == (8, 64, 32)  # transformers 5's fused name


class _ShapeOnlyBackend:
    """The attention backend's forward as a shape-only stand-in: what runs on meta tensors
    is then the model's own code."""

    def forward(self, q, k, v, kv_cache, md, **kw):
        return torch.empty_like(q)


@pytest.mark.parametrize("name", ["olmoe", "granitemoeshared"])
def test_steps_up_to_512_tokens_have_no_host_sync(tiny, name):
    """What makes these models capturable in CUDA graphs: a step of up to 512 tokens runs on
    meta tensors, which hold no data (a host sync raises); at 513 the experts' grouped path
    reads its counts back, as the check must see."""
    from flashpage.engine.cuda_graph import DecodeGraphs

    model = load_model(resolve_model(str(tiny(name))), torch.float32, torch.device("cpu"))
    assert model.max_graph_tokens == 512
    meta = torch.device("meta")
    model = model.to(meta)
    for layer in model.attention_layers():
        layer.kv_cache = (torch.empty(1, device=meta), torch.empty(1, device=meta))
        layer.backend = _ShapeOnlyBackend()
    graphs = DecodeGraphs(model, 513, 4, meta)
    with torch.inference_mode():
        for bs in (1, 16, 512):
            out = model(graphs.input_ids[:bs], graphs.positions[:bs], graphs.metadata(bs, 16))
            assert out.shape == (bs, model.config.hidden_size)
        with pytest.raises((NotImplementedError, RuntimeError)):
            model(graphs.input_ids, graphs.positions, graphs.metadata(513, 16))


# ----------------------------------------------------------------- inspect
@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    path = tiny(name)
    cfg = ModelConfig.from_hf(path)
    total, active = param_counts(cfg)
    assert total == transformers.AutoModelForCausalLM.from_pretrained(path).num_parameters()
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    assert total == sum(p.numel() for p in model.parameters())
    idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * 3 * 64 * 32
    assert total - active == 2 * idle
    report = format_report(inspect_config(cfg, 1 << 30, "fp32"))
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    assert f"{k} of {e} per token (intermediate 32" in report and "in 2 of 2 layers" in report
    assert ("a shared MLP of 48" in report) == (name == "granitemoeshared")


@pytest.mark.parametrize("name", ["olmoe", "granitemoeshared"])
def test_inspect_weight_bytes_equal_the_loaded_models_fp8_too(tiny, name):
    """Under ``--quantization fp8`` attention and GraniteMoeShared's shared MLP go e4m3; the
    router and the routed experts stay 16-bit: inspect counts the model's bytes exactly."""
    from flashpage.bench.common import weight_bytes

    path = tiny(name)
    cfg = ModelConfig.from_hf(path)
    for q in (None, "fp8"):
        model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"),
                           quantization=q)
        info = inspect_config(cfg, 1 << 30, "fp32", quantization=q)
        assert info["weights_bytes"] == weight_bytes(model), q
    mlp = model.model.layers[1].mlp
    assert mlp.experts.gate_up_proj.dtype == torch.float32
    if name == "granitemoeshared":
        assert mlp.shared_mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert info["fp8_linears"] == 2 * 4  # qkv, o, shared input / output linears


# OLMoE-1B-7B-0924's config.json (allenai/OLMoE-1B-7B-0924)
OLMOE_1B_7B = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304,
                   hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                   num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None,
                   max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def test_inspect_counts_olmoe_1b_7b():
    """The OLMoE paper's 6.9B parameters, 1.3B active; KV as 16 MHA layers."""
    info = inspect_config(ModelConfig.from_hf(OLMOE_1B_7B), 80 << 30, "bf16")
    assert info["param_count"] == pytest.approx(6.92e9, rel=0.005)
    assert info["active_param_count"] == pytest.approx(1.28e9, rel=0.01)
    assert info["kv_bytes_per_token"] == 2 * 16 * 128 * 2 * 16
    assert info["moe"]["moe_layers"] == 16 and info["moe"]["shared_intermediate_size"] == 0


# ----------------------------------------------------------------- config
def _raw(name: str, **edit) -> dict:
    cls_name, extra = TINY[name]
    d = getattr(transformers, cls_name)(
        vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
        **extra).to_dict()
    d["architectures"] = [ARCH[cls_name]]
    d.update(edit)
    return d


def test_config_fields():
    olmoe = ModelConfig.from_hf(_raw("olmoe"))
    assert (olmoe.n_routed_experts, olmoe.num_experts_per_tok, olmoe.moe_intermediate_size,
            olmoe.norm_topk_prob, olmoe.clip_qkv, olmoe.rms_norm_eps) == (8, 2, 32, False, CLIP, 1e-5)
    assert not olmoe.qk_norm and olmoe.sliding_window is None  # its norms are olmo2.py's own
    assert all(olmoe.is_moe_layer(i) for i in range(2))
    # OlmoeConfig's defaults where a field is absent: eps 1e-5, no renormalization, no clamp
    bare = {k: v for k, v in _raw("olmoe_norm").items()
            if k not in ("rms_norm_eps", "norm_topk_prob", "clip_qkv", "architectures")}
    olmoe = ModelConfig.from_hf(bare)
    assert olmoe.architecture == "OlmoeForCausalLM"  # from model_type alone
    assert (olmoe.rms_norm_eps, olmoe.norm_topk_prob, olmoe.clip_qkv) == (1e-5, False, None)
    granite = ModelConfig.from_hf(_raw("granitemoeshared", sliding_window=64))
    assert (granite.embedding_multiplier, granite.residual_multiplier,
            granite.attention_multiplier, granite.logits_scaling) == (12.0, 0.22, 0.09, 8.0)
    assert (granite.n_routed_experts, granite.num_experts_per_tok, granite.moe_intermediate_size,
            granite.shared_expert_intermediate_size, granite.norm_topk_prob) == (6, 3, 32, 48, True)
    assert granite.sliding_window is None  # transformers' Granite MoE attends to all
    plain = ModelConfig.from_hf({k: v for k, v in _raw("granitemoe").items()
                                 if k not in ("architectures", "embedding_multiplier")})
    assert plain.architecture == "GraniteMoeForCausalLM" and plain.embedding_multiplier == 1.0
    assert plain.shared_expert_intermediate_size == 0
    assert not ModelConfig.from_hf(_raw("granitemoeshared", shared_intermediate_size=0)
                                   ).shared_expert_intermediate_size


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("olmoe", dict(num_experts_per_tok=9),
     r"num_experts_per_tok \(9\) must be at most num_experts \(8\)"),
    ("olmoe", dict(num_experts=None), "num_experts must be a positive integer"),
    ("olmoe", dict(intermediate_size=0), "intermediate_size must be a positive integer"),
    ("olmoe", dict(clip_qkv=-1.0), "clip_qkv must be a positive number or null, got -1.0"),
    ("olmoe", dict(clip_qkv="8"), "clip_qkv must be a positive number or null"),
    ("olmoe", dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
    ("olmoe", dict(head_dim=32), r"head_dim 32 .* not supported for OlmoeForCausalLM \(its "
                                 r"q_norm spans hidden_size"),
    ("olmoe", dict(sliding_window=16), "sliding_window is not supported for OlmoeForCausalLM"),
    ("olmoe", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for OlmoeForCausalLM"),
    ("granitemoe", dict(num_local_experts=0), "num_local_experts must be a positive integer"),
    ("granitemoe", dict(num_experts_per_tok=9),
     r"num_experts_per_tok \(9\) must be at most num_local_experts \(8\)"),
    ("granitemoe", dict(logits_scaling=0), "logits_scaling must be a positive number, got 0"),
    ("granitemoe", dict(attention_multiplier="0.1"), "attention_multiplier must be a positive"),
    ("granitemoe", dict(hidden_act="gelu"),
     "hidden_act 'gelu' is not supported for GraniteMoeForCausalLM"),
    ("granitemoeshared", dict(shared_intermediate_size=-1),
     r"shared_intermediate_size must be an integer >= 0 \(0: no shared MLP\), got -1"),
])
def test_bad_config_is_a_clear_error(name, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(name, **edit))


def test_bad_config_stops_the_engine_before_loading(tiny, tmp_path):
    bad = edited_copy(tiny("olmoe"), tmp_path / "bad", config_edit=lambda c: c.update(clip_qkv=0))
    with pytest.raises(ConfigError, match="clip_qkv must be a positive number or null, got 0"):
        LLM(str(bad), dtype="float32", device="cpu")


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path: Path, name: str) -> Path:
    """head_dim 64, a Triton attention tile unpadded."""
    return build_tiny(tmp_path / name, name, hidden_size=128, num_attention_heads=2,
                      num_key_value_heads=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_graphs_and_fused_moe_give_transformers_tokens(tmp_path, name, monkeypatch):
    """fp32 on the triton backend: CUDA graphs = eager = transformers' tokens over shrinking
    decode batches (conftest's assert_gpu_graphs_match_hf), the fused MoE kernel running."""
    path = _gpu_checkpoint(tmp_path, name)
    fused = count_expert_path(monkeypatch, "fused")
    prompts = random_prompts(10, 1, 120, seed=22)
    prompts.append(prompts[3] + [5, 6, 7])  # a prefix hit
    assert_gpu_graphs_match_hf(path, prompts)
    assert fused, "the fused MoE kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 (triton, graphs, fused MoE) against transformers' fp32 tokens, teacher-forced:
    ours picks fp32's token as often as transformers' own bf16 does (conftest's
    bf16_teacher_forced_hits: greedy bf16 runs of a tiny random MoE part chaotically)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton",
                                            block_size=16)
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total, (ours16, hf16, total)
