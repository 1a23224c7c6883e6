"""DeepSeek-V2/V3 (MLA + MoE) in the engine: token for token with transformers (fp32, CPU),
the absorbed (decode) and expanded (prefill) attention paths agree, one latent cached,
and a decode step has no host sync (so it can be captured in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.attention.triton import TritonBackend
from flashpage.engine.cuda_graph import DecodeGraphs
from flashpage.layers.mla_attention import MLAAttention, mla_decode_torch, mla_prefill_torch
from flashpage.models.loader import iter_safetensors, load_model, resolve_model
from tests.conftest import (
    TINY_MLA_MODELS,
    assert_staggered_matches_hf,
    hf_greedy,
    random_prompts,
    step_metadata,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NAMES = sorted(TINY_MLA_MODELS)


def latent_dim(cfg) -> int:
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_with_one_latent_cached(tiny_mla_checkpoint, name):
    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(3, 5, 40, seed=1)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = llm.engine
    assert engine.kv_manager.stats().blocks_used == 0

    # The cache: one [num_blocks, block_size, R + rope] tensor per layer, nothing else.
    cfg = engine.model_config
    shape = (engine.num_blocks, 8, latent_dim(cfg))
    caches = engine.runner.kv_caches
    assert len(caches) == cfg.num_hidden_layers
    assert all(isinstance(c, torch.Tensor) and c.shape == shape for c in caches)
    layers = engine.model.attention_layers()
    assert all(isinstance(la, MLAAttention) and la.kv_cache is c for la, c in zip(layers, caches, strict=True))
    cached_bytes = sum(c.numel() * c.element_size() for c in caches)
    # All the KV memory is latents: (R + rope) values per token per layer, no K or V.
    assert cached_bytes == engine.num_blocks * 8 * cfg.kv_bytes_per_token("float32")
    assert cfg.kv_bytes_per_token("float32") == 4 * latent_dim(cfg) * cfg.num_hidden_layers


@pytest.mark.parametrize("name", NAMES)
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny_mla_checkpoint, name):
    """10 prompts (4 sharing a 32-token prefix) arrive over several steps into a cache too
    small for all of them: chunked prefill (expanded path over a cached prefix), preemption
    and prefix hits all happen, decodes share steps with chunks, and every output still
    equals transformers'."""
    assert_staggered_matches_hf(tiny_mla_checkpoint(name), attention_backend="torch_native")


# ----------------------------------------------------------------- the two paths, one step
class SpyBackend:
    """Routes MLA attention through the backend hooks, counting which path ran."""

    def __init__(self) -> None:
        self.calls = {"decode": 0, "prefill": 0}

    def forward_mla_decode(self, *args, **kwargs):
        self.calls["decode"] += 1
        return mla_decode_torch(*args, **kwargs)

    def forward_mla_prefill(self, *args, **kwargs):
        self.calls["prefill"] += 1
        return mla_prefill_torch(*args, **kwargs)



@pytest.mark.parametrize("name", NAMES)
def test_absorbed_and_expanded_paths_agree_on_the_same_step(tiny_mla_checkpoint, name):
    """Three requests prefilled into scattered blocks, then one decode step run twice: as
    decodes (absorbed query over the latent, MQA) and as 1-token prefills (latents expanded
    to per-head K/V). Hidden states agree within fp32 rounding; both match transformers."""
    import transformers

    path = tiny_mla_checkpoint(name)
    source = resolve_model(str(path))
    cfg = source.config
    model = load_model(source, torch.float32, torch.device("cpu"))
    block_size, num_blocks = 4, 32
    spy = SpyBackend()
    for layer in model.attention_layers():
        layer.kv_cache = torch.full(layer.kv_cache_shape(num_blocks, block_size), float("nan"))
        layer.backend = spy

    lens = [6, 13, 21]
    prompts = [random_prompts(1, n, n, seed=20 + i)[0] for i, n in enumerate(lens)]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(5)).tolist()
    tables, used = [], 0
    for n in lens:
        k = (n + 1 + block_size - 1) // block_size  # room for the decoded token
        tables.append(perm[used:used + k])
        used += k

    with torch.no_grad():
        md, pos = step_metadata(lens, lens, tables, block_size, num_decodes=0)
        hidden = model(torch.tensor(sum(prompts, [])), pos, md)
        last = torch.tensor(lens).cumsum(0) - 1
        next_ids = model.compute_logits(hidden[last]).argmax(-1)
        assert spy.calls == {"decode": 0, "prefill": cfg.num_hidden_layers}

        outs = {}
        for nd in (3, 0):
            spy.calls = {"decode": 0, "prefill": 0}
            md, pos = step_metadata([1, 1, 1], [n + 1 for n in lens], tables, block_size, num_decodes=nd)
            outs[nd] = model(next_ids, pos, md)
            path_ran = "decode" if nd else "prefill"
            assert spy.calls[path_ran] == cfg.num_hidden_layers and sum(spy.calls.values()) == spy.calls[path_ran]
        absorbed, expanded = outs[3], outs[0]
        assert torch.isfinite(absorbed).all()
        torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)

        # Both equal transformers' logits at the decoded position.
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for i, p in enumerate(prompts):
            ids = torch.tensor([p + [int(next_ids[i])]])
            want = hf(ids).logits[0, -1]
            for h in (absorbed, expanded):
                torch.testing.assert_close(model.compute_logits(h[i]), want, rtol=1e-4, atol=1e-4)


def test_load_weights_fuses_experts_and_reports_what_is_missing(tiny_mla_checkpoint):
    path = tiny_mla_checkpoint("deepseek_v3")
    source = resolve_model(str(path))
    model = load_model(source, torch.float32, torch.device("cpu"))
    ref = dict(iter_safetensors(str(path)))
    # Expert 5 of layer 1, gate and up rows, ended up in their slices of the fused weight.
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    inter = fused.shape[1] // 2
    assert torch.equal(fused[5, :inter], ref["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fused[5, inter:], ref["model.layers.1.mlp.experts.5.up_proj.weight"])
    bias = model.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, ref["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert bias.abs().sum() > 0  # the checkpoint's bias, not the zero init

    # One expert piece short: the fused weight is not reported loaded.
    partial = [(n, t) for n, t in ref.items() if n != "model.layers.2.mlp.experts.7.up_proj.weight"]
    loaded = model.load_weights(partial)
    assert "model.layers.2.mlp.experts.gate_up_proj" not in loaded
    assert "model.layers.2.mlp.experts.down_proj" in loaded
    # V3 checkpoints carry a multi-token-prediction layer past num_hidden_layers: skipped.
    n = source.config.num_hidden_layers
    model.load_weights([(f"model.layers.{n}.eh_proj.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="has no place"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(2, 2))])


# ----------------------------------------------------------------- CUDA-graph safety
class ShapeOnlyMLABackend:
    """The triton backend's MLA decode hooks (cache write, decode kernel) as shape-only
    stand-ins: what runs on meta tensors is then the model's own code."""

    def write_mla_cache(self, latent, kv_cache, slot_mapping) -> None:
        assert latent.shape[0] == slot_mapping.shape[0]

    def forward_mla_decode(self, q, kv_cache, md, *, kv_lora_rank, scale):
        return q.new_empty(*q.shape[:2], kv_lora_rank)


def meta_decode_step(model, bs: int, width: int = 4) -> torch.Tensor:
    """One decode step of ``bs`` requests on meta tensors with the metadata the CUDA-graph
    runner captures with (no host-side lengths). Meta tensors hold no data: ``.item()``,
    ``bool()``, ``.tolist()`` and data-dependent shapes (bincount, nonzero, masks) raise."""
    meta = torch.device("meta")
    for layer in model.attention_layers():
        layer.kv_cache = torch.empty(layer.kv_cache_shape(8, 4), device=meta)
        layer.backend = ShapeOnlyMLABackend()
    graphs = DecodeGraphs(model, bs, width, meta)
    md = graphs.metadata(bs, width * 4)
    assert md.seq_lens_cpu == [] and md.query_lens_cpu == []
    with torch.inference_mode():
        hidden = model(graphs.input_ids[:bs], graphs.positions[:bs], md)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("name", NAMES)
def test_decode_step_has_no_host_sync(tiny_mla_checkpoint, name):
    """What makes DeepSeek capturable: the MoE's sync-free path, the MLA decode path with
    static shapes, the backend's cache-write and decode hooks (triton has both)."""
    path = tiny_mla_checkpoint(name)
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    assert model.supports_cuda_graphs
    for hook in ("write_mla_cache", "forward_mla_decode"):
        assert callable(getattr(TritonBackend, hook, None)), hook
    model = model.to("meta")
    for bs in (1, 3, 16):  # gathered-weights MoE at 1, all-experts above
        assert meta_decode_step(model, bs).shape == (bs, model.config.vocab_size)
    # The check bites: the grouped MoE path reads its expert sizes back to the host.
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.sync_free_max_tokens = -1
    with pytest.raises((NotImplementedError, RuntimeError)):
        meta_decode_step(model, 3)


@pytest.mark.parametrize("name", NAMES)
def test_piecewise_step_has_no_host_sync(tiny_mla_checkpoint, name):
    """What makes DeepSeek's piecewise graphs capturable: every piece (the forward with MLA's
    attend cut out, engine/cuda_graph.PiecewiseGraphs) of up to 512 tokens runs on meta
    tensors, so nothing in it reads the device back; at 513 the MoE's grouped path does."""
    from flashpage.engine.cuda_graph import PiecewiseGraphs

    path = tiny_mla_checkpoint(name)
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    assert model.max_graph_tokens == 512
    meta = torch.device("meta")
    model = model.to(meta)
    for layer in model.attention_layers():
        layer.kv_cache = torch.empty(layer.kv_cache_shape(8, 4), device=meta)
        layer.backend = ShapeOnlyMLABackend()
    cores = []

    def split(run, inputs, out_shape):
        cores.append(run)
        return torch.empty(out_shape, device=meta)

    pg = PiecewiseGraphs(model, 1024, meta)
    with torch.inference_mode():
        for tokens in (16, 96, 512):
            assert pg._forward(tokens, split).shape == (tokens, model.config.hidden_size)
        assert len(cores) == 3 * model.config.num_hidden_layers
        with pytest.raises((NotImplementedError, RuntimeError)):
            pg._forward(513, split)


@pytest.mark.parametrize("name", NAMES)
def test_piecewise_steps_give_the_plain_steps_tokens(tiny_mla_checkpoint, name):
    """The padded piecewise steps (run eagerly here) with MLA's attend over each step's own
    metadata: prompts alone and together, decodes beside a prompt chunk, equal tokens."""
    from flashpage.engine.cuda_graph import PiecewiseGraphs

    path = str(tiny_mla_checkpoint(name))
    prompts = random_prompts(3, 3, 20, seed=61) + random_prompts(1, 40, 40, seed=62)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, block_size=8)
    ref = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **kw)
    llm.engine.runner.capture_piecewise_graphs(32, capture=False)
    runs = []
    real = PiecewiseGraphs.run

    def spy(self, input_ids, positions, md):
        runs.append((md.num_decodes, md.num_seqs))
        return real(self, input_ids, positions, md)

    PiecewiseGraphs.run = spy  # type: ignore[method-assign]
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        PiecewiseGraphs.run = real  # type: ignore[method-assign]
    assert got == ref
    assert any(0 < d < s for d, s in runs), runs  # a mixed step went through the pieces
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
