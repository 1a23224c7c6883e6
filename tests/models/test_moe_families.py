"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama body with MoE MLPs (models/llama.py,
layers/moe.SparseMoeBlock).

CPU, fp32: greedy tokens equal transformers' on each expert path (sync-free, grouped, the
fused Triton kernel and router in the interpreter), with dense layers where
``mlp_only_layers`` / ``decoder_sparse_step`` put them, Qwen2-MoE's gated shared expert,
``norm_topk_prob`` true and false; the routers and MoE blocks against transformers' own
modules; Mixtral's checkpoint names; config errors (tests/test_inspect_moe.py: what
``flashpage inspect`` counts).
GPU (marked gpu): CUDA graphs and the fused kernels in fp32 give transformers' tokens, and
bf16 follows fp32 about as far as transformers' bf16 does.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.moe import SparseMoeBlock
from flashpage.models.loader import ModelLoadError, iter_safetensors, load_model, resolve_model
from tests.conftest import (
    TINY_MOE_MODELS,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    build_tiny_moe_checkpoint,
    count_expert_path,
    edited_copy,
    hf_greedy,
    random_prompts,
    use_expert_path,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NAMES = sorted(TINY_MOE_MODELS)
# which layers hold the experts (the rest: a dense MLP of intermediate_size)
MOE_LAYERS = {"mixtral": [True, True], "qwen2_moe": [True, True],
              "qwen3_moe": [False, True],  # mlp_only_layers [0]
              "qwen3_moe_step2": [False, True]}  # decoder_sparse_step 2
# Triton runs on the GPU where there is one, else in its interpreter (tests/conftest.py).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("path", ["sync_free", "grouped"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny_moe_checkpoint, name, path, monkeypatch):
    ckpt = tiny_moe_checkpoint(name)
    prompts = random_prompts(3, 5, 40, seed=1)
    expected = hf_greedy(ckpt, prompts, GREEDY.max_tokens)
    llm = LLM(str(ckpt), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native")
    model = llm.engine.model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == MOE_LAYERS[name]
    use_expert_path(model, path)
    calls = count_expert_path(monkeypatch, path)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and min(calls) <= 3 and max(calls) > 5  # decode steps and prompts took this path
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_greedy_matches_transformers_on_the_fused_kernel(tiny_moe_checkpoint, name, monkeypatch):
    """kernels/fused_moe.py and kernels/moe_router.py (renormalizing for Mixtral, not for
    this Qwen2-MoE), in the Triton interpreter on the CPU."""
    ckpt = tiny_moe_checkpoint(name)
    prompts = random_prompts(2, 5, 30, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = hf_greedy(ckpt, prompts, params.max_tokens)
    llm = LLM(str(ckpt), dtype="float32", device=DEV, block_size=8,
              attention_backend="torch_native")
    use_expert_path(llm.engine.model, "fused")
    calls = count_expert_path(monkeypatch, "fused")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and min(calls) <= 2 and max(calls) > 5


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny_moe_checkpoint, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens."""
    assert_staggered_matches_hf(tiny_moe_checkpoint(name), attention_backend="torch_native")


# ----------------------------------------------------------------- against HF's modules
def _hf_config(kind: str, **kw):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, **kw)
    cls = transformers.Qwen2MoeConfig if kind == "qwen2_moe" else transformers.Qwen3MoeConfig
    extra = dict(shared_expert_intermediate_size=40) if kind == "qwen2_moe" else {}
    return cls(**common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
               **extra, **kw)


BLOCKS = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
          "qwen3_moe": Qwen3MoeSparseMoeBlock}
BLOCK_CASES = [("mixtral", {}), ("qwen2_moe", dict(norm_topk_prob=False)),
               ("qwen2_moe", dict(norm_topk_prob=True)), ("qwen3_moe", dict(norm_topk_prob=True)),
               ("qwen3_moe", dict(norm_topk_prob=False))]


def _hf_block(kind: str, kw: dict, seed: int) -> tuple[torch.nn.Module, ModelConfig]:
    conf = _hf_config(kind, **kw)
    hf = BLOCKS[kind](conf).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return hf, ModelConfig.from_hf(conf.to_dict())


@pytest.mark.parametrize("path", ["sync_free", "grouped", "fused"])
@pytest.mark.parametrize(("kind", "kw"), BLOCK_CASES,
                         ids=["mixtral", "qwen2_plain", "qwen2_norm", "qwen3_norm", "qwen3_plain"])
def test_moe_block_matches_hf(kind, kw, path):
    hf, cfg = _hf_block(kind, kw, seed=3)
    assert cfg.norm_topk_prob == (kind == "mixtral" or kw["norm_topk_prob"])
    ours = SparseMoeBlock(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)  # HF's fused experts, split shared expert
    assert (ours.shared_expert is not None) == (kind == "qwen2_moe")
    ours = ours.to(DEV)
    use_expert_path(ours, path)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(x)
        got = ours(x.to(DEV)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize(("kind", "kw"), BLOCK_CASES,
                         ids=["mixtral", "qwen2_plain", "qwen2_norm", "qwen3_norm", "qwen3_plain"])
def test_router_matches_hf(kind, kw, fused):
    """MoEGate (torch, or kernels/moe_router.py) against transformers' router: the same
    experts and weights; summed to 1 exactly when the family renormalizes."""
    hf, cfg = _hf_block(kind, kw, seed=5)
    ours = SparseMoeBlock(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    gate = ours.gate.to(DEV)
    gate.fused_route = fused
    x = torch.randn(33, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, want_w, want_ids = hf.gate(x)
        got_w, got_ids = (t.cpu() for t in gate(x.to(DEV)))
    want_order, got_order = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(got_order.values, want_order.values)
    torch.testing.assert_close(got_w.gather(1, got_order.indices),
                               want_w.float().gather(1, want_order.indices), rtol=1e-5, atol=1e-6)
    sums = got_w.sum(-1)
    if cfg.norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones(33))
    else:
        assert (sums < 1 - 1e-3).all()  # 3 of 8 softmax scores: not renormalized


# ----------------------------------------------------------------- loading
def test_mixtral_expert_names_load_into_the_fused_weights(tiny_moe_checkpoint, tmp_path):
    ckpt = tiny_moe_checkpoint("mixtral")
    model = load_model(resolve_model(str(ckpt)), torch.float32, torch.device("cpu"))
    ref = dict(iter_safetensors(str(ckpt)))
    p = "model.layers.1.block_sparse_moe"
    assert f"{p}.experts.5.w1.weight" in ref  # the on-disk form really is Mixtral's
    moe = model.model.layers[1].mlp
    inter = moe.experts.gate_up_proj.shape[1] // 2
    assert torch.equal(moe.experts.gate_up_proj[5, :inter], ref[f"{p}.experts.5.w1.weight"])
    assert torch.equal(moe.experts.gate_up_proj[5, inter:], ref[f"{p}.experts.5.w3.weight"])
    assert torch.equal(moe.experts.down_proj[5], ref[f"{p}.experts.5.w2.weight"])
    assert torch.equal(moe.gate.weight, ref[f"{p}.gate.weight"])

    missing = edited_copy(ckpt, tmp_path / "missing", lambda t: t.pop(f"{p}.experts.5.w3.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(resolve_model(str(missing)), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="expert 8 >= the model's 8 experts"):
        model.load_weights([(f"{p}.experts.8.w1.weight", ref[f"{p}.experts.5.w1.weight"])])


def test_qwen2_moe_shared_expert_loads_and_gives_hf_weights_back(tiny_moe_checkpoint):
    ckpt = tiny_moe_checkpoint("qwen2_moe")
    model = load_model(resolve_model(str(ckpt)), torch.float32, torch.device("cpu"))
    ref = dict(iter_safetensors(str(ckpt)))
    mine = dict(model.hf_weights())
    for name in ("model.layers.0.mlp.shared_expert.gate_proj.weight",
                 "model.layers.0.mlp.shared_expert.up_proj.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(mine[name], ref[name]), name
    # the routed experts come back under transformers 5's fused names
    assert mine["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)


def test_lora_targets_skip_the_routed_experts(tiny_moe_checkpoint):
    """Adapters reach attention, dense MLPs and Qwen2-MoE's shared expert, never a linear
    that is not there (layer 1's MLP is experts)."""
    model = load_model(resolve_model(str(tiny_moe_checkpoint("qwen3_moe"))), torch.float32,
                       torch.device("cpu"))
    targets = model.lora_targets()
    modules = dict(model.named_modules())
    assert all(ours in modules for ours, _, _ in targets.values())
    assert "model.layers.0.mlp.down_proj" in targets and "model.layers.0.mlp.gate_proj" in targets
    assert "model.layers.1.self_attn.q_proj" in targets
    assert not any(hf.startswith("model.layers.1.mlp") for hf in targets)
    q2 = load_model(resolve_model(str(tiny_moe_checkpoint("qwen2_moe"))), torch.float32,
                    torch.device("cpu")).lora_targets()
    assert q2["model.layers.1.mlp.shared_expert.up_proj"] == (
        "model.layers.1.mlp.shared_expert.gate_up_proj", 48, 48)


class _ShapeOnlyBackend:
    """The attention backend's forward as a shape-only stand-in: what runs on meta tensors
    is then the model's own code."""

    def forward(self, q, k, v, kv_cache, md, **kw):
        return torch.empty_like(q)


@pytest.mark.parametrize("name", NAMES)
def test_steps_up_to_512_tokens_have_no_host_sync(tiny_moe_checkpoint, name):
    """What makes these models capturable in CUDA graphs (decode, prompt-only and piecewise,
    up to ``max_graph_tokens``): a step of up to 512 tokens runs on meta tensors, which hold
    no data (``.tolist()``, ``bool()``, data-dependent shapes raise); at 513 the experts'
    grouped path reads its counts back, as the check must see."""
    from flashpage.engine.cuda_graph import DecodeGraphs

    model = load_model(resolve_model(str(tiny_moe_checkpoint(name))), torch.float32,
                       torch.device("cpu"))
    assert model.max_graph_tokens == 512
    meta = torch.device("meta")
    model = model.to(meta)
    for layer in model.attention_layers():
        layer.kv_cache = (torch.empty(1, device=meta), torch.empty(1, device=meta))
        layer.backend = _ShapeOnlyBackend()
    graphs = DecodeGraphs(model, 513, 4, meta)
    with torch.inference_mode():
        for bs in (1, 3, 16, 512):  # gathered-weights experts at 1, all-experts above
            out = model(graphs.input_ids[:bs], graphs.positions[:bs], graphs.metadata(bs, 16))
            assert out.shape == (bs, model.config.hidden_size)
        with pytest.raises((NotImplementedError, RuntimeError)):
            model(graphs.input_ids, graphs.positions, graphs.metadata(513, 16))


# ----------------------------------------------------------------- config
def _raw(kind: str, **kw) -> dict:
    d = _hf_config(kind).to_dict()
    d.update(kw)
    return d


@pytest.mark.parametrize(("kind", "edit", "message"), [
    ("qwen3_moe", dict(num_experts_per_tok=9),
     r"num_experts_per_tok \(9\) must be at most num_(local_)?experts \(8\)"),
    ("mixtral", dict(num_experts_per_tok=9),
     r"num_experts_per_tok \(9\) must be at most num_local_experts \(8\)"),
    ("mixtral", dict(num_local_experts=None), "num_local_experts must be a positive integer"),
    ("qwen2_moe", dict(num_experts_per_tok=0), "num_experts_per_tok must be a positive integer"),
    ("qwen2_moe", dict(mlp_only_layers=[2]), r"mlp_only_layers must be a list of layer indices in \[0, 2\)"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
    ("qwen3_moe", dict(mlp_only_layers=[1], intermediate_size=None),
     r"intermediate_size must be a positive integer \(dense MLP in layer\(s\) 1\)"),
    ("qwen3_moe", dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=None),
     "shared_expert_intermediate_size must be a positive integer"),
    ("qwen2_moe", dict(use_sliding_window=True), "use_sliding_window is not supported for Qwen2-MoE"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for MixtralForCausalLM"),
])
def test_bad_moe_config_is_a_clear_error(kind, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(kind, **edit))


def test_bad_config_stops_the_engine_before_loading(tiny_moe_checkpoint, tmp_path):
    bad = edited_copy(tiny_moe_checkpoint("qwen2_moe"), tmp_path / "bad",
                      config_edit=lambda c: c.update(num_experts_per_tok=9))
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\) must be at most num_experts \(8\)"):
        LLM(str(bad), dtype="float32", device="cpu")


def test_config_fields_and_moe_layers():
    q2 = ModelConfig.from_hf(_raw("qwen2_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                  mlp_only_layers=[3]))
    assert [q2.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert (q2.n_routed_experts, q2.num_experts_per_tok, q2.moe_intermediate_size,
            q2.shared_expert_intermediate_size) == (8, 3, 24, 40)
    assert q2.attention_bias and not q2.qk_norm and q2.sliding_window is None
    assert not ModelConfig.from_hf(_raw("qwen2_moe", qkv_bias=False)).attention_bias
    q3 = ModelConfig.from_hf(_raw("qwen3_moe"))
    assert q3.qk_norm and not q3.attention_bias and q3.n_routed_experts == 8
    # the hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts
    assert ModelConfig.from_hf({k: v for k, v in _raw("qwen3_moe").items()
                                if k != "num_local_experts"} | {"num_experts": 6}).n_routed_experts == 6
    mx = ModelConfig.from_hf(_raw("mixtral", sliding_window=4096, norm_topk_prob=False))
    assert mx.norm_topk_prob and mx.moe_intermediate_size == 48 and mx.sliding_window == 4096
    assert all(mx.is_moe_layer(i) for i in range(2))


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path, name):
    """head_dim 64, a Triton attention tile unpadded."""
    return build_tiny_moe_checkpoint(tmp_path / name, name, hidden_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64)


def _tokens(path, backend, dtype, prompts, params, **kw):
    llm = LLM(str(path), dtype=dtype, device="cuda", attention_backend=backend, block_size=16, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_graphs_and_fused_moe_give_transformers_tokens(tmp_path, name, monkeypatch):
    path = _gpu_checkpoint(tmp_path, name)
    # seed 22: transformers' fp32 top-2 logits are >= 2.7e-3 apart at every step of every
    # family, far above what fp32 on the GPU and on the CPU differ by
    prompts = random_prompts(10, 1, 120, seed=22)
    prompts.append(prompts[3] + [5, 6, 7])  # a prefix hit
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]  # decode batches shrink through the graph sizes
    fused = count_expert_path(monkeypatch, "fused")
    graphs, llm = _tokens(path, "triton", "float32", prompts, params, max_num_seqs=16)
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    assert fused, "the fused MoE kernel did not run"
    eager, _ = _tokens(path, "triton", "float32", prompts, params, enforce_eager=True)
    assert graphs == eager
    longest = hf_greedy(path, prompts, params[-1].max_tokens)  # greedy: shorter runs are prefixes
    assert graphs == [t[:sp.max_tokens] for t, sp in zip(longest, params, strict=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 greedy paths of a tiny random MoE part from fp32 at near-ties (expert choices
    flip too): ours (triton, graphs, fused MoE) picks fp32's token as often as transformers'
    own bf16 does, teacher-forced (conftest's bf16_teacher_forced_hits)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton",
                                            block_size=16)
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total, (ours16, hf16, total)
