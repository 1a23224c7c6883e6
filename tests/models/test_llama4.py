"""Llama 4's text model (Llama4ForCausalLM): chunked local attention on its rotary layers,
NoPE layers with attention temperature tuning, L2 q/k norms after rotary, and interleaved
MoE layers (sigmoid top-k routing that scales the experts' input, a shared expert):
models/llama4.py, config._llama4_fields, the chunk mask of attention/torch_native.py.

CPU, fp32: greedy tokens equal transformers' on prompts past the chunk; the chunks, the
temperature tuning, the L2 norms and the NoPE layers each shown to change the tokens;
prompt logprobs equal transformers'; chunked prefill / preemption / prefix hits (chunks
across cached prefixes and decode steps); every expert path (sync-free, grouped, the fused
MoE kernel in the Triton interpreter) and the MoE block against transformers' own; a model
with and without chunks on our Triton kernels (interpreter: chunked prefill, decodes
across chunk starts); the flex backend refuses chunked layers with a reason; weights back under HF's names (the experts' transposed fused
tensors); ``flashpage inspect``'s counts (tiny and Scout's / Maverick's shapes) and rows;
config fields, transformers' derived defaults and errors.
GPU (marked gpu): fp32 gives transformers' tokens (torch_native and triton with chunks, CUDA
graphs), bf16 follows fp32 about as far as transformers' bf16 does.

Every test needs transformers' Llama4TextConfig: it is skipped where it is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.attention.registry import BackendUnavailable, backend_reasons
from flashpage.attention.torch_native import causal_mask
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import format_report, inspect_config, param_counts
from flashpage.layers.moe import FusedExperts, set_fused_moe
from flashpage.models.llama4 import Llama4MoE
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import (
    _checkpoints,
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    bf16_teacher_forced_hits,
    cpu_greedy,
    cpu_llm,
    hf_greedy,
    load_and_round_trip,
    random_prompts,
    tiny_table_builder,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CHUNK = 8  # the chunked layers' chunk: the prompts run past several
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHUNKED, FULL = "chunked_attention", "full_attention"

_SMALL = dict(num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
              num_local_experts=4)
# name -> (HF config class name, extra config kwargs); hidden 64, 4 heads
TINY: dict[str, tuple[str, dict]] = {
    # Scout's layout, shrunk: every 2nd layer NoPE (1, 3) and global, the others rotary and
    # chunked; MoE on every 2nd layer (1, 3), top-1 of 4; L2 q/k norms; temperature tuning
    # on a floor_scale short enough to change within the prompts
    "llama4": ("Llama4TextConfig", dict(_SMALL, num_hidden_layers=4, no_rope_layer_interval=2,
                                        interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
                                        floor_scale=4, attn_scale=0.5)),
    # no chunks, no q/k norms, no temperature tuning; every layer MoE, top-2; biases; a tied
    # head; llama3 rope scaling (Scout's kind)
    "llama4_top2": ("Llama4TextConfig", dict(
        _SMALL, num_hidden_layers=2, no_rope_layer_interval=2, num_experts_per_tok=2,
        attention_chunk_size=None, use_qk_norm=False, attn_temperature_tuning=False,
        attention_bias=True, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))),
}
NAMES = sorted(TINY)


def _require() -> None:
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama4TextConfig")


_build = tiny_table_builder(TINY)


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    _require()
    return _build(path, name, seed, **overrides)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _prompts() -> list[list[int]]:
    return random_prompts(3, 3 * CHUNK, 40, seed=1)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    assert cpu_greedy(path, _prompts()) == hf_greedy(path, _prompts(), GREEDY.max_tokens)


def test_layers_are_built_as_configured(tiny):
    layers = cpu_llm(tiny("llama4")).engine.model.model.layers
    assert [lay.self_attn.rotary_emb is not None for lay in layers] == [True, False] * 2
    assert [lay.self_attn.attn.chunk_size for lay in layers] == [CHUNK, None] * 2
    assert [lay.self_attn.l2_eps is not None for lay in layers] == [True, False] * 2
    assert [lay.self_attn.temperature for lay in layers] == [None, (4.0, 0.5)] * 2
    assert [isinstance(lay.mlp, Llama4MoE) for lay in layers] == [False, True] * 2
    assert not layers[0].self_attn.rotary_emb.is_neox  # interleaved pairs
    assert layers[1].mlp.router.weight.dtype == torch.float32  # the model's dtype here
    top2 = cpu_llm(tiny("llama4_top2")).engine.model.model.layers
    assert [lay.self_attn.attn.chunk_size for lay in top2] == [None, None]
    assert all(isinstance(lay.mlp, Llama4MoE) and lay.mlp.top_k == 2 for lay in top2)
    assert top2[1].self_attn.temperature is None and top2[0].self_attn.l2_eps is None
    # CUDA graphs: 256 tokens, 512 expert rows, all on the sync-free (capturable) path
    assert cpu_llm(tiny("llama4_top2")).engine.model.max_graph_tokens == 256


def test_each_difference_changes_the_tokens(tiny):
    """Ours equal transformers' (test_greedy_matches_transformers) and each of these matters
    on these prompts: the chunks, the temperature tuning, the L2 norms, the NoPE layers."""
    prompts = _prompts()[:2]
    base = cpu_greedy(tiny("llama4"), prompts)

    def differs(**overrides) -> bool:
        return cpu_greedy(tiny("llama4"), prompts, hf_overrides=overrides) != base

    assert differs(attention_chunk_size=512)
    assert differs(attn_temperature_tuning=False)
    assert differs(use_qk_norm=False)
    assert differs(no_rope_layers=[1, 1, 1, 1], layer_types=[CHUNKED] * 4)


def test_prompt_logprobs_match_transformers(tiny):
    """The logits themselves: each prompt token's logprob is transformers' log-softmax."""
    path = tiny("llama4")
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
    (attention chunks across prompt chunks, cached prefixes and decode steps)."""
    assert_staggered_matches_hf(tiny("llama4"), attention_backend="torch_native")


@pytest.mark.parametrize(("q_len", "k_len", "chunk", "window"), [
    (20, 20, 8, None), (5, 23, 8, None), (1, 17, 8, None), (1, 16, 8, None), (7, 30, 4, 6)])
def test_chunk_mask_is_the_rule(q_len, k_len, chunk, window):
    """Query at p sees key j iff j <= p, j // chunk == p // chunk (and p - window < j)."""
    got = causal_mask(q_len, k_len, window, torch.device("cpu"), chunk)
    for i in range(q_len):
        p = k_len - q_len + i
        want = [j <= p and j // chunk == p // chunk and (window is None or j > p - window)
                for j in range(k_len)]
        assert got[i].tolist() == want


# ----------------------------------------------------------------- MoE
def _use_path(model: torch.nn.Module, path: str) -> None:
    set_fused_moe(model, path == "fused")
    for m in model.modules():
        if isinstance(m, FusedExperts):
            m.sync_free_max_tokens = -1 if path == "grouped" else 10**9


@pytest.mark.parametrize("path", ["sync_free", "grouped", "fused"])
def test_moe_greedy_matches_transformers_on_every_expert_path(tiny, path, monkeypatch):
    """Top-2 routing with pre-scaled inputs, sync-free, grouped, or through
    kernels/fused_moe.py (Triton interpreter on the CPU), each seen to run."""
    ckpt = tiny("llama4_top2")
    prompts = random_prompts(2, 5, 30, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(ckpt), dtype="float32", device=DEV if path == "fused" else "cpu",
              block_size=8, attention_backend="torch_native")
    _use_path(llm.engine.model, path)
    calls: list[int] = []
    original = getattr(FusedExperts, f"forward_{path}")

    def spy(self, x, *a):
        calls.append(x.shape[0])
        return original(self, x, *a)

    monkeypatch.setattr(FusedExperts, f"forward_{path}", spy)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, prompts, params.max_tokens)
    assert calls and min(calls) <= 4 and max(calls) > 10  # (2 rows a token)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_block_matches_hf(top_k):
    """Llama4MoE against transformers' Llama4TextMoe on the same weights."""
    _require()
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    conf = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=8, num_experts_per_tok=top_k)
    torch.manual_seed(3)
    hf = Llama4TextMoe(conf).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    cfg = ModelConfig.from_hf({**conf.to_dict(), "architectures": ["Llama4ForCausalLM"]})
    ours = Llama4MoE(cfg)
    sd = hf.state_dict()
    with torch.no_grad():
        ours.router.weight.copy_(sd["router.weight"])
        ours.experts.gate_up_proj.copy_(sd["experts.gate_up_proj"].transpose(1, 2))
        ours.experts.down_proj.copy_(sd["experts.down_proj"].transpose(1, 2))
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat(
            [sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]]))
        ours.shared_expert.down_proj.weight.copy_(sd["shared_expert.down_proj.weight"])
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, _ = hf(x)
        got = ours(x)
    torch.testing.assert_close(got, want.view(got.shape), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- backends
def test_flex_refuses_chunked_layers_triton_takes_them(tiny):
    cfg = ModelConfig.from_hf(tiny("llama4"))
    reasons = backend_reasons("flex", cfg, torch.device("cuda"), torch.bfloat16)
    assert any("chunked local attention (attention_chunk_size 8: Llama 4's "
               "chunked_attention layers) is not supported by the flex backend" in r
               for r in reasons), reasons
    with pytest.raises(BackendUnavailable, match="chunked local attention"):
        LLM(str(tiny("llama4")), dtype="float32", device="cpu", attention_backend="flex")
    assert not backend_reasons("torch_native", cfg, torch.device("cpu"), torch.float32)
    # our Triton kernels take the chunks (kernels/flash_prefill.py, paged_decode.py)
    assert not any("chunk" in r for r in backend_reasons("triton", cfg, torch.device("cuda"),
                                                         torch.bfloat16))


def _gpu_checkpoint(tmp_path: Path, name: str, **overrides) -> Path:
    """head_dim 64, the smallest the Triton attention kernels take. Without a chunk size the
    GPU image's transformers (5.17) still writes chunked_attention layer_types (and then
    cannot generate: its sliding cache layer gets no window, and it derives them again where
    the file has none): written as full_attention, what 5.24 derives."""
    kw = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    path = build_tiny(tmp_path / name, name, **{**kw, **overrides})
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("attention_chunk_size") is None and "chunked_attention" in cfg.get("layer_types", ()):
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_on_our_kernels_matches_transformers(tmp_path):
    """Without chunks the triton backend runs Llama 4 (interpreter on the CPU): our rotary
    kernel on its own (q/k handed over rotated), the plain cache write."""
    path = _gpu_checkpoint(tmp_path, "llama4_top2", use_qk_norm=True)
    prompts = random_prompts(1, 20, 20, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    assert llm.engine.model.model.layers[0].self_attn.rotary_emb.fused
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


def test_chunked_on_our_kernels_matches_transformers(tmp_path):
    """Chunks of 8 on the triton backend (interpreter on the CPU, fp32, blocks of 16): our
    paged prefill over prompt chunks of 16 tokens after cached prefixes (chunk starts inside
    the kernel's query and key tiles) and our paged decode across chunk starts (a query
    alone in its new chunk) give torch_native's tokens and transformers'."""
    path = _gpu_checkpoint(tmp_path, "llama4")
    prompts = random_prompts(2, 21, 30, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = hf_greedy(path, prompts, params.max_tokens)
    whole = _gpu_checkpoint(tmp_path / "whole", "llama4", attention_chunk_size=512)
    assert hf_greedy(whole, prompts, params.max_tokens) != want  # the chunks matter here
    kw = dict(dtype="float32", device=DEV, block_size=16, max_num_batched_tokens=16)
    for backend in ("triton", "torch_native"):
        llm = LLM(str(path), attention_backend=backend, **kw)
        assert [lay.self_attn.attn.chunk_size for lay in llm.engine.model.model.layers] == [
            CHUNK, None, CHUNK, None]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, backend


# ----------------------------------------------------------------- loading, inspect
@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    model, ref = load_and_round_trip(tiny(name))
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in ref  # [E, H, 2I] there
    assert ref["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 64, 64)
    assert model.model.layers[1].mlp.experts.down_proj.shape == (4, 64, 32)  # [E, H, I] here


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_are_the_models_own(tiny, name):
    path = tiny(name)
    source = resolve_model(str(path))
    model = load_model(source, torch.float32, torch.device("cpu"))
    total, active = param_counts(source.config)
    assert total == sum(p.numel() for p in model.parameters())
    assert total == transformers.AutoModelForCausalLM.from_pretrained(path).num_parameters()
    cfg = source.config
    moe = sum(isinstance(lay.mlp, Llama4MoE) for lay in model.model.layers)
    assert total - active == moe * (4 - cfg.num_experts_per_tok) * 3 * 64 * 32


# the released config.json shapes (text_config)
FULL_SIZE = {
    "scout": dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                  intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                  num_key_value_heads=8, head_dim=128, num_local_experts=16,
                  interleave_moe_layer_step=1, attention_chunk_size=8192),
    "maverick": dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                     intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                     num_key_value_heads=8, head_dim=128, num_local_experts=128,
                     interleave_moe_layer_step=2, attention_chunk_size=8192, use_qk_norm=False),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_inspect_counts_full_size_models(name):
    """Scout (109B, 17B active) and Maverick (400B, 17B active) text models against
    transformers' on the meta device; KV bytes, the NoPE and chunk rows."""
    _require()
    hf_cfg = transformers.Llama4TextConfig(**FULL_SIZE[name])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["Llama4ForCausalLM"]})
    info = inspect_config(cfg, 80 * 2**30)
    assert info["param_count"] == hf.num_parameters()
    assert info["param_count"] == pytest.approx(107.8e9 if name == "scout" else 400.7e9, rel=1e-2)
    assert info["active_param_count"] == pytest.approx(17.2e9, rel=2e-2)
    assert info["kv_bytes_per_token"] == 2 * 8 * 128 * 2 * 48
    report = format_report(info)
    assert "all dims, interleaved pairs (GPT-J's layout); none on 12 of 48 layers (NoPE)" in report
    assert "chunks of 8,192 on 36 of 48 layers" in report


def test_inspect_cli_reports_the_chunks(tiny, capsys):
    from flashpage.inspect import main

    assert main([str(tiny("llama4"))]) == 0
    out = capsys.readouterr().out
    assert "Llama4ForCausalLM (llama4_text)" in out and "chunks of 8 on 2 of 4 layers" in out
    assert "experts" in out and "1 of 4 per token" in out and "in 2 of 4 layers" in out


# ----------------------------------------------------------------- config
def _raw(name: str, **edit) -> dict:
    _require()
    _, extra = TINY[name]
    d = transformers.Llama4TextConfig(vocab_size=256, hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=512, **extra).to_dict()
    d["architectures"] = ["Llama4ForCausalLM"]
    d.update(edit)
    return d


@pytest.mark.parametrize(("layers", "interval", "step", "chunk"), [
    (8, 4, 1, 8192), (6, 2, 2, 16), (4, 1, 4, None), (5, 3, 3, 32)])
def test_layer_kinds_from_the_intervals_as_transformers(layers, interval, step, chunk):
    """Configs without no_rope_layers / layer_types / moe_layers: transformers' rules."""
    kw = dict(num_hidden_layers=layers, no_rope_layer_interval=interval,
              interleave_moe_layer_step=step, attention_chunk_size=chunk)
    hf = transformers.Llama4TextConfig(**kw) if hasattr(transformers, "Llama4TextConfig") else None
    if hf is None:
        pytest.skip("no Llama4TextConfig")
    raw = {k: v for k, v in _raw("llama4").items()
           if k not in ("no_rope_layers", "layer_types", "moe_layers")} | kw
    c = ModelConfig.from_hf(raw)
    assert [int(c.uses_rope(i)) for i in range(layers)] == hf.no_rope_layers
    assert list(c.layer_types) == hf.layer_types
    assert [i for i in range(layers) if c.is_moe_layer(i)] == hf.moe_layers
    assert [c.attention_chunk(i) for i in range(layers)] == [
        chunk if t == CHUNKED else None for t in hf.layer_types]


def test_config_fields():
    c = ModelConfig.from_hf(_raw("llama4"))
    assert (c.architecture, c.nope_layers, c.layer_types, c.attention_chunk_size, c.qk_l2_norm,
            c.nope_attn_temperature, c.rope_interleaved, c.qk_norm) == (
        "Llama4ForCausalLM", (1, 3), (CHUNKED, FULL) * 2, CHUNK, True, (4.0, 0.5), True, False)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size, c.intermediate_size) == (4, 1, 32, 32, 128)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    # Llama4TextConfig's defaults where config.json says nothing
    bare = {k: v for k, v in _raw("llama4").items() if k not in (
        "rope_parameters", "rms_norm_eps", "floor_scale", "attn_scale", "use_qk_norm",
        "attention_chunk_size", "head_dim", "num_key_value_heads")}
    c = ModelConfig.from_hf(bare | {"num_attention_heads": 16})
    assert (c.rope_theta, c.rms_norm_eps, c.nope_attn_temperature, c.qk_l2_norm,
            c.attention_chunk_size, c.head_dim, c.num_key_value_heads) == (
        500_000.0, 1e-5, (8192.0, 0.1), True, 8192, 128, 8)
    c = ModelConfig.from_hf(_raw("llama4_top2"))
    assert (c.layer_types, c.attention_chunk_size, c.nope_attn_temperature, c.qk_l2_norm,
            c.attention_bias, c.o_proj_bias, c.rope_scaling.rope_type) == (
        (FULL, FULL), None, None, False, True, True, "llama3")
    assert ModelConfig.from_hf({k: v for k, v in _raw("llama4").items()
                                if k != "architectures"}).architecture == "Llama4ForCausalLM"
    # the published Scout / Maverick files say 4: an integer read for its truth
    assert ModelConfig.from_hf(_raw("llama4", attn_temperature_tuning=4)).nope_attn_temperature == (4.0, 0.5)
    assert ModelConfig.from_hf(_raw("llama4", attn_temperature_tuning=0)).nope_attn_temperature is None


@pytest.mark.parametrize(("edit", "message"), [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for Llama4ForCausalLM"),
    (dict(num_key_value_heads=3), "num_attention_heads \\(4\\) is not a multiple of "
     "num_key_value_heads \\(3\\)"),
    (dict(head_dim=-1), "head_dim must be a positive integer, got -1"),
    (dict(num_local_experts=0), "num_local_experts must be a positive integer, got 0"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok \\(5\\) must be at most "
     "num_local_experts \\(4\\)"),
    (dict(moe_layers=[1, 4]), "moe_layers must list layer indices in \\[0, 4\\), got \\[1, 4\\]"),
    (dict(moe_layers=None, interleave_moe_layer_step=0),
     "interleave_moe_layer_step must be a positive integer, got 0"),
    (dict(no_rope_layers=[1, 0, 1]), "no_rope_layers must list 1 \\(rotary\\) or 0 \\(NoPE\\) "
     "for each of the 4 layers, got \\[1, 0, 1\\]"),
    (dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must list"),
    (dict(no_rope_layers=None, no_rope_layer_interval=0),
     "no_rope_layer_interval must be a positive integer, got 0"),
    (dict(attention_chunk_size=0), "attention_chunk_size must be a positive integer or null, "
     "got 0"),
    (dict(attention_chunk_size=None), "layer_types has chunked_attention layers but "
     "attention_chunk_size is null"),
    (dict(layer_types=[CHUNKED, "sliding_attention", CHUNKED, FULL]),
     "layer_types must list one of chunked_attention, full_attention for each of the 4 layers"),
    (dict(intermediate_size_mlp=0), "intermediate_size_mlp must be a positive integer "
     "\\(dense MLP in layer\\(s\\) 0, 2\\), got 0"),
    (dict(intermediate_size=None), "intermediate_size must be a positive integer, got None"),
    (dict(floor_scale=0), "floor_scale must be a positive number, got 0"),
    (dict(use_qk_norm="yes"), "use_qk_norm must be true or false, got 'yes'"),
    (dict(attn_temperature_tuning="yes"), "attn_temperature_tuning must be true, false or a "
     "non-negative integer, got 'yes'"),
    (dict(attn_temperature_tuning=-1), "attn_temperature_tuning must be true, false or a "
     "non-negative integer, got -1"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32}),
     "gptq \\(int4\\) checkpoints are read for the dense Llama, Gemma and Llama-variant "
     "families and Mixtral / Qwen2-MoE / Qwen3-MoE, not Llama4ForCausalLM"),
])
def test_bad_config_is_a_clear_error(edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw("llama4", **edit))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_chunked_on_torch_native_gives_transformers_tokens(tmp_path):
    path = _gpu_checkpoint(tmp_path, "llama4")
    prompts = random_prompts(8, 1, 120, seed=28)
    llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="torch_native",
              block_size=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_chunked_on_our_kernels_and_graphs_give_transformers_tokens(tmp_path):
    """The chunked model on the triton backend: prefill and decode kernels with chunks of 8,
    CUDA graphs and eagerly."""
    path = _gpu_checkpoint(tmp_path, "llama4")
    assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_kernels_and_graphs_without_chunks_give_transformers_tokens(tmp_path):
    """Where transformers cannot run Llama 4 without chunks (the GPU image's 5.17), against
    our torch_native tokens on the CPU, which equal transformers 5.24's (the CPU tests)."""
    path = _gpu_checkpoint(tmp_path, "llama4_top2", use_qk_norm=True)

    def ours_on_the_cpu(path, prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return cpu_greedy(path, prompts, params, block_size=16)

    assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28),
                               reference=None if _hf_runs_without_chunks(path) else ours_on_the_cpu)


def _hf_runs_without_chunks(path: Path) -> bool:
    """transformers 5.17 builds a chunked mask for every Llama 4 and raises without a chunk
    size ("Could not find an `attention_chunk_size`"); 5.24 runs it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    try:
        with torch.no_grad():
            model(torch.tensor([[3, 4, 5]]))
    except ValueError as e:
        if "attention_chunk_size" in str(e):
            return False
        raise
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 against transformers' fp32 tokens, teacher-forced (conftest's
    bf16_teacher_forced_hits) on the triton backend, the chunked model's too."""
    path = _gpu_checkpoint(tmp_path, name)
    if not _hf_runs_without_chunks(path):
        pytest.skip(f"transformers {transformers.__version__} cannot run Llama 4 without chunks")
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton",
                                            block_size=16)
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total, (ours16, hf16, total)
