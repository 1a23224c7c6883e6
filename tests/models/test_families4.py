"""SmolLM3 (Llama with NoPE layers: no_rope_layers / no_rope_layer_interval), Arcee / AFM
(Llama with a non-gated ReLU^2 MLP), Ministral (Mistral with per-layer windows, layer_types),
OLMo 3 (OLMo2 with per-layer windows and a rope per layer kind), ERNIE 4.5 (Llama with
rotary on interleaved pairs), Seed-OSS (Llama with o_proj's bias apart from q/k/v's),
EXAONE 4 (OLMo2's post-norms, per-head q/k norms, NoPE on its full-attention layers) and
HunYuan dense (per-head q/k norms after rotary, an alpha-stretched rope base) and Apertus
(xIELU in a non-gated MLP, per-head q/k norms): models/llama.py, arcee.py, olmo2.py,
hunyuan.py, apertus.py; config._families4_fields.

CPU, fp32: greedy tokens equal transformers' for each family on prompts past the windows;
NoPE, the windows, ReLU^2, OLMo 3's two rope bases, ERNIE's interleaved pairs and HunYuan's
alpha each shown to change the tokens; prompt logprobs equal transformers' log-softmax;
chunked prefill / preemption / prefix hits; SmolLM3 and HunYuan on our Triton kernels
(interpreter: the fused rotary + cache write on SmolLM3's rotary layers, the plain cache
write on its NoPE ones; our rotary kernel on its own before HunYuan's q/k norms); weights
back under HF's names (Arcee's up_proj / down_proj); ``flashpage inspect``'s parameter
counts (tiny and the released shapes) and rows; config fields, transformers' derived
defaults and errors.
GPU (marked gpu): fp32 on the Triton kernels and CUDA graphs gives transformers' tokens, and
bf16 follows fp32 about as far as transformers' bf16 does.

Every test needs transformers' config class for its family (SmolLM3Config, ArceeConfig,
MinistralConfig, Olmo3Config, Ernie4_5Config, SeedOssConfig, Exaone4Config,
HunYuanDenseV1Config, ApertusConfig: transformers 4.53-4.57): it is skipped where the installed
transformers lacks it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import param_counts
from flashpage.layers.rotary import get_rope
from tests.conftest import (
    _checkpoints,
    assert_dense_params_match_hf,
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
WINDOW = 16  # the sliding layers' window: the prompts run past it
SLIDE, FULL = "sliding_attention", "full_attention"
TWO_ROPES = {SLIDE: {"rope_type": "default", "rope_theta": 10_000.0},
             FULL: {"rope_type": "default", "rope_theta": 500_000.0}}

ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10_000.0, "factor": 1.0}

# name -> (HF config class name, extra config kwargs); hidden 64, 4 heads
TINY: dict[str, tuple[str, dict]] = {
    # NoPE on every 2nd layer (1 and 3), GQA, an untied head
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, num_key_value_heads=2,
                                      no_rope_layer_interval=2)),
    # use_sliding_window: its NoPE layer (1) windowed, as SmolLM3Config derives it; biases
    # (o_proj's too), a tied head
    "smollm3_window": ("SmolLM3Config", dict(num_hidden_layers=2, no_rope_layers=[1, 0],
                                             use_sliding_window=True, sliding_window=WINDOW,
                                             attention_bias=True, tie_word_embeddings=True)),
    # up_proj -> relu^2 -> down_proj; GQA
    "arcee": ("ArceeConfig", dict(num_hidden_layers=2, num_key_value_heads=2)),
    # mlp_bias and attention_bias, a tied head
    "arcee_bias": ("ArceeConfig", dict(num_hidden_layers=2, mlp_bias=True, attention_bias=True,
                                       tie_word_embeddings=True)),
    # a sliding layer, then a full one; head_dim set (MinistralConfig has no default)
    "ministral": ("MinistralConfig", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                          layer_types=[SLIDE, FULL], sliding_window=WINDOW)),
    # a sliding layer (rope base 1e4), then a full one (5e5)
    "olmo3": ("Olmo3Config", dict(num_hidden_layers=2, num_key_value_heads=2,
                                  layer_types=[SLIDE, FULL], sliding_window=WINDOW,
                                  rope_parameters=TWO_ROPES)),
    # rotary on interleaved pairs; head_dim set (Ernie4_5Config's default is 128)
    "ernie": ("Ernie4_5Config", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)),
    # a head_dim other than hidden / heads, a tied head
    "ernie_tied": ("Ernie4_5Config", dict(num_hidden_layers=2, num_key_value_heads=4,
                                          head_dim=32, tie_word_embeddings=True)),
    # q/k/v biased (SeedOssConfig's default), o_proj not
    "seed_oss": ("SeedOssConfig", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)),
    # the other way round: o_proj alone biased
    "seed_oss_out": ("SeedOssConfig", dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=32,
                                           attention_bias=False, attention_out_bias=True)),
    # every 2nd layer full attention and NoPE (1, 3), the others windowed and rotating
    "exaone4": ("Exaone4Config", dict(num_hidden_layers=4, num_key_value_heads=2,
                                      sliding_window=WINDOW, sliding_window_pattern=2)),
    # no window: every layer full and rotating (EXAONE-4.0-1.2B's layout), a tied head
    "exaone4_global": ("Exaone4Config", dict(num_hidden_layers=2, num_key_value_heads=4,
                                             sliding_window=None, layer_types=[FULL, FULL],
                                             tie_word_embeddings=True)),
    # q/k norms after rotary; head_dim set (transformers' model needs one)
    "hunyuan": ("HunYuanDenseV1Config", dict(num_hidden_layers=2, num_key_value_heads=2,
                                             head_dim=16)),
    # Hunyuan-7B's "dynamic" rope with a fixed alpha, attention biases
    "hunyuan_alpha": ("HunYuanDenseV1Config", dict(num_hidden_layers=2, num_key_value_heads=4,
                                                   head_dim=32, attention_bias=True,
                                                   rope_parameters=ALPHA)),
    # xIELU, ApertusConfig's llama3 rope (its original length under the prompts' span)
    "apertus": ("ApertusConfig", dict(num_hidden_layers=2, num_key_value_heads=2,
                                      rope_parameters=dict(
                                          rope_type="llama3", rope_theta=12_000_000.0, factor=8.0,
                                          original_max_position_embeddings=32,
                                          low_freq_factor=1.0, high_freq_factor=4.0))),
    # a plain activation (relu2) instead, attention biases, a tied head, the default rope
    "apertus_plain": ("ApertusConfig", dict(num_hidden_layers=2, num_key_value_heads=4,
                                            hidden_act="relu2", attention_bias=True,
                                            tie_word_embeddings=True, rope_parameters=dict(
                                                rope_type="default", rope_theta=10_000.0))),
}
NAMES = sorted(TINY)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_class(name: str) -> str:
    """The family's transformers config class name; skips the test where it is missing
    (an older transformers, e.g. a GPU image's)."""
    cls_name = TINY[name][0]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return cls_name


_build = tiny_table_builder(TINY)


def build_tiny(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    _hf_class(name)
    return _build(path, name, seed, **overrides)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _prompts() -> list[list[int]]:
    return random_prompts(3, WINDOW + 4, 40, seed=1)  # past the windows


def _arch(name: str) -> str:
    return _hf_class(name).replace("Config", "ForCausalLM")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tiny, name):
    path = tiny(name)
    assert cpu_greedy(path, _prompts()) == hf_greedy(path, _prompts(), GREEDY.max_tokens)


def test_layers_rotate_and_window_as_configured(tiny):
    """SmolLM3: no rotary on its NoPE layers (and a window on its one NoPE layer where
    use_sliding_window says so); Ministral / OLMo 3: a window on the sliding layers; OLMo 3:
    each kind its own rope base; Arcee: the ReLU^2 MLP under our c_fc / c_proj."""
    def layers(name):
        return cpu_llm(tiny(name)).engine.model.model.layers

    smol = layers("smollm3")
    assert [lay.self_attn.rotary_emb is not None for lay in smol] == [True, False, True, False]
    assert [lay.self_attn.attn.sliding_window for lay in smol] == [None] * 4
    assert smol[0].self_attn.rotary_emb.is_neox
    win = layers("smollm3_window")
    assert [lay.self_attn.attn.sliding_window for lay in win] == [None, WINDOW]
    assert [lay.self_attn.rotary_emb is not None for lay in win] == [True, False]
    for name in ("ministral", "olmo3"):
        assert [lay.self_attn.attn.sliding_window for lay in layers(name)] == [WINDOW, None]
    olmo = layers("olmo3")
    for lay, base in zip(olmo, (10_000.0, 500_000.0), strict=True):
        want = 1.0 / base ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        torch.testing.assert_close(lay.self_attn.rotary_emb.inv_freq.double(), want)
    mlp = layers("arcee")[0].mlp
    assert mlp.act.hidden_act == "relu2" and mlp.c_fc.bias is None
    assert not layers("ernie")[0].self_attn.rotary_emb.is_neox  # interleaved pairs
    exa = layers("exaone4")
    assert [lay.self_attn.attn.sliding_window for lay in exa] == [WINDOW, None] * 2
    assert [lay.self_attn.rotary_emb is not None for lay in exa] == [True, False] * 2
    assert tuple(exa[0].self_attn.q_norm.weight.shape) == (16,)  # per head, not hidden-wide
    hun = layers("hunyuan")[0].self_attn  # norms of head_dim, after the rotary it runs itself
    assert tuple(hun.query_layernorm.weight.shape) == (16,) and not hun.qk_norm
    ap = layers("apertus")[0]
    assert type(ap.mlp.act).__name__ == "XIELU" and ap.self_attn.qk_norm
    assert layers("apertus_plain")[0].mlp.act.hidden_act == "relu2"
    glob = layers("exaone4_global")
    assert [lay.self_attn.attn.sliding_window for lay in glob] == [None, None]
    assert all(lay.self_attn.rotary_emb is not None for lay in glob)
    for name, qkv, o in (("seed_oss", True, False), ("seed_oss_out", False, True)):
        attn = layers(name)[1].self_attn
        assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == (qkv, o)


def test_nope_windows_relu2_and_rope_bases_each_change_the_tokens(tiny):
    """Each difference matters on these prompts (and ours equal transformers',
    test_greedy_matches_transformers): SmolLM3's and EXAONE 4's NoPE layers rotated,
    Ministral, OLMo 3 and EXAONE 4 without their windows, Arcee with ReLU for ReLU^2, OLMo 3
    with one rope base, HunYuan without its alpha, ERNIE rotating halves."""
    prompts = _prompts()[:2]
    base: dict[str, list[list[int]]] = {}

    def differs(name: str, llm=None, **overrides) -> bool:
        if name not in base:
            base[name] = cpu_greedy(tiny(name), prompts)
        if llm is None:
            return cpu_greedy(tiny(name), prompts, hf_overrides=overrides) != base[name]
        return [o.outputs[0].token_ids
                for o in llm.generate(prompts, GREEDY, use_tqdm=False)] != base[name]

    assert differs("smollm3", no_rope_layers=[1, 1, 1, 1])
    for name in ("smollm3", "exaone4"):  # by hand: rotate the NoPE layers as the others
        llm = cpu_llm(tiny(name))
        for lay in llm.engine.model.model.layers:
            if lay.self_attn.rotary_emb is None:
                lay.self_attn.rotary_emb = get_rope(llm.engine.model.config, 512, 0)
        assert differs(name, llm)
    for name in ("ministral", "olmo3", "exaone4"):
        assert differs(name, sliding_window=512)
    assert differs("arcee", hidden_act="relu")
    assert differs("olmo3", rope_parameters={SLIDE: TWO_ROPES[FULL], FULL: TWO_ROPES[FULL]})
    assert differs("hunyuan_alpha", rope_parameters={**ALPHA, "alpha": 1.0})
    llm = cpu_llm(tiny("ernie"))  # rotate halves (Llama's layout) instead of interleaved pairs
    halves = replace(llm.engine.model.config, rope_interleaved=False)
    for lay in llm.engine.model.model.layers:
        lay.self_attn.rotary_emb = get_rope(halves, 512, 0)
    assert differs("ernie", llm)


@pytest.mark.parametrize("name", ["smollm3_window", "arcee_bias", "olmo3", "ernie_tied",
                                  "seed_oss_out", "exaone4", "hunyuan_alpha", "apertus"])
def test_prompt_logprobs_match_transformers(tiny, name):
    """The logits themselves, not only their argmax: each prompt token's logprob is
    transformers' log-softmax."""
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


@pytest.mark.parametrize("name", [  # EXAONE 4: NoPE, windows and post-norms at once
    "exaone4", pytest.param("smollm3_window", marks=pytest.mark.slow),
    pytest.param("olmo3", marks=pytest.mark.slow)])
def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny, name):
    """10 prompts (4 sharing a 32-token prefix) over several steps into a cache too small
    for all: chunked prefill, preemption, prefix hits, mixed steps; transformers' tokens
    (unrotated cached keys on the NoPE layers, windows over chunks)."""
    assert_staggered_matches_hf(tiny(name), attention_backend="torch_native")


@pytest.mark.parametrize("name", ["smollm3", "hunyuan"])
def test_on_our_kernels_matches_transformers(tmp_path, name):
    """The triton backend (interpreter on the CPU), one short prompt, head_dim 64 (the
    smallest the kernels take). SmolLM3: the fused rotary + cache-write kernel on its rotary
    layer, the plain cache write on its NoPE one. HunYuan: our rotary kernel on its own
    (q/k normed after it), then the plain cache write."""
    path = _gpu_checkpoint(tmp_path, name, num_hidden_layers=2)
    prompts = random_prompts(1, 20, 20, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device=DEV, block_size=16, attention_backend="triton")
    layers = llm.engine.model.model.layers
    assert layers[0].self_attn.rotary_emb.fused
    assert (layers[1].self_attn.rotary_emb is None) == (name == "smollm3")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, params.max_tokens)


# ----------------------------------------------------------------- layers
def test_relu2_is_transformers_relu_squared():
    from transformers.activations import ACT2FN

    from flashpage.layers.activation import PlainActivation

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(PlainActivation("relu2")(x), ACT2FN["relu2"](x))
    assert torch.equal(PlainActivation("relu2")(-x.abs()), torch.zeros_like(x))


def test_xielu_is_transformers_xielu():
    """Our xIELU against transformers' (its Python form), at its init and at other learned
    scalars, over both branches and around eps."""
    from transformers.activations import XIELUActivation

    from flashpage.layers.activation import XIELU

    x = torch.cat([torch.randn(256, generator=torch.Generator().manual_seed(1)) * 4,
                   torch.tensor([0.0, -1e-7, -1e-6, 1e-7])])
    ours, hf = XIELU(), XIELUActivation(dtype=torch.float32)
    assert torch.equal(ours(x), hf(x))
    with torch.no_grad():
        for m in (ours, hf):
            m.alpha_p.fill_(0.3)
            m.alpha_n.fill_(-1.2)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    assert (ours(x) != XIELU()(x)).any()  # the learned scalars matter


# ----------------------------------------------------------------- loading, inspect
@pytest.mark.parametrize("name", NAMES)
def test_weights_come_back_under_hf_names(tiny, name):
    model, ref = load_and_round_trip(tiny(name))
    if name == "apertus":  # xIELU's scalars and constant buffers, under HF's names
        assert {"model.layers.1.mlp.act_fn.alpha_p", "model.layers.1.mlp.act_fn.beta",
                "model.layers.0.feedforward_layernorm.weight"} <= ref.keys()
    if name.startswith("arcee"):  # the checkpoint's names, not our c_fc / c_proj
        assert "model.layers.0.mlp.up_proj.weight" in ref
        assert ("model.layers.0.mlp.up_proj.bias" in ref) == (name == "arcee_bias")
        assert model.lora_targets()["model.layers.1.mlp.up_proj"] == (
            "model.layers.1.mlp.c_fc", 0, 128)
        assert "model.layers.0.mlp.gate_proj" not in model.lora_targets()


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_transformers_parameters(tiny, name):
    assert_dense_params_match_hf(tiny(name))


# the released config.json shapes (rope scaling left out: the counts do not read it)
FULL_SIZE = {
    "smollm3": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                    num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                    max_position_embeddings=65536, rope_theta=5_000_000.0,
                    no_rope_layer_interval=4),  # SmolLM3-3B
    "arcee": dict(vocab_size=128004, hidden_size=2560, intermediate_size=18432,
                  num_hidden_layers=36, num_attention_heads=20, num_key_value_heads=4,
                  head_dim=128, max_position_embeddings=65536),  # AFM-4.5B
    "ministral": dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=32768, sliding_window=32768,
                      rope_theta=100_000_000.0),  # Ministral-8B-Instruct-2410
    "olmo3": dict(vocab_size=100278, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=65536, sliding_window=4096,
                  rope_theta=500_000.0),  # Olmo-3-7B
    "ernie": dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=128, max_position_embeddings=131072,
                  tie_word_embeddings=True),  # ERNIE-4.5-0.3B
    "seed_oss": dict(vocab_size=155136, hidden_size=5120, intermediate_size=27648,
                     num_hidden_layers=64, num_attention_heads=80, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=524288,
                     rope_theta=10_000_000.0),  # Seed-OSS-36B
    "exaone4": dict(vocab_size=102400, hidden_size=5120, intermediate_size=27392,
                    num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=131072, sliding_window=4096,
                    sliding_window_pattern=4, rope_theta=1_000_000.0),  # EXAONE-4.0-32B
    "hunyuan": dict(vocab_size=128167, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True,
                    rope_parameters={**ALPHA, "rope_theta": 10_000.0}),  # Hunyuan-7B
    "apertus": dict(vocab_size=131072, hidden_size=4096, intermediate_size=21504,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=65536),  # Apertus-8B
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_inspect_counts_full_size_models(name):
    """The released shapes, against transformers' model built on the meta device; the
    report's NoPE and window rows."""
    from flashpage.inspect import format_report, inspect_config

    hf_cfg = getattr(transformers, _hf_class(name))(**FULL_SIZE[name])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [_arch(name)]})
    assert param_counts(cfg) == (hf.num_parameters(),) * 2
    report = format_report(inspect_config(cfg, 80 * 2**30))
    if name == "smollm3":
        assert "all dims; none on 9 of 36 layers (NoPE)" in report
    if name == "olmo3":
        assert "4096 on 24 of 32 layers" in report
    if name == "ministral":  # every layer sliding (MinistralConfig's default layer_types)
        assert cfg.layer_types == (SLIDE,) * 36 and cfg.sliding_window == 32768
    if name == "ernie":
        assert "all dims, interleaved pairs (GPT-J's layout)" in report
    if name == "exaone4":
        assert "all dims; none on 16 of 64 layers (NoPE)" in report
        assert "4096 on 48 of 64 layers" in report


def test_inspect_reports_nope_layers(tiny, capsys):
    from flashpage.inspect import main

    assert main([str(tiny("smollm3"))]) == 0
    out = capsys.readouterr().out
    assert "SmolLM3ForCausalLM (smollm3)" in out
    assert "all dims; none on 2 of 4 layers (NoPE)" in out
    assert main([str(tiny("arcee"))]) == 0
    out = capsys.readouterr().out
    assert "ArceeForCausalLM (arcee)" in out and "NoPE" not in out


# ----------------------------------------------------------------- config
def _raw(name: str, **edit) -> dict:
    cls_name, extra = TINY[name]
    d = getattr(transformers, _hf_class(name))(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=512, **extra).to_dict()
    d["architectures"] = [cls_name.replace("Config", "ForCausalLM")]
    d.update(edit)
    return d


def _bare(name: str, *drop: str) -> dict:
    """``_raw(name)`` without ``drop`` and without what transformers derives from it: what
    an older or hand-written config.json holds."""
    return {k: v for k, v in _raw(name).items() if k not in drop}


@pytest.mark.parametrize(("layers", "interval"), [(8, 4), (5, 2), (3, 1), (4, None)])
def test_smollm3_nope_layers_from_the_interval_as_transformers(layers, interval):
    """Configs without no_rope_layers: transformers' rule from no_rope_layer_interval
    (default 4), and each layer's window from use_sliding_window."""
    kw = {} if interval is None else {"no_rope_layer_interval": interval}
    for windowed in (False, True):
        hf = transformers.SmolLM3Config(num_hidden_layers=layers, use_sliding_window=windowed,
                                        sliding_window=32, **kw)
        raw = {**_bare("smollm3", "no_rope_layers", "layer_types", "no_rope_layer_interval"),
               "num_hidden_layers": layers, "use_sliding_window": windowed,
               "sliding_window": 32, **kw}
        c = ModelConfig.from_hf(raw)
        assert [c.uses_rope(i) for i in range(layers)] == [bool(r) for r in hf.no_rope_layers]
        assert list(c.layer_types) == hf.layer_types
        assert [c.attention_window(i) for i in range(layers)] == [
            32 if t == SLIDE else None for t in hf.layer_types]


def test_config_fields():
    c = ModelConfig.from_hf(_raw("smollm3"))
    assert (c.architecture, c.nope_layers, c.sliding_window) == ("SmolLM3ForCausalLM", (1, 3), None)
    assert [c.attention_window(i) for i in range(4)] == [None] * 4
    # SmolLM3Config's defaults where config.json says nothing: rope base 2e6, a tied head
    bare = _bare("smollm3", "architectures", "rope_parameters", "tie_word_embeddings")
    c = ModelConfig.from_hf(bare)
    assert (c.architecture, c.rope_theta, c.tie_word_embeddings) == (
        "SmolLM3ForCausalLM", 2_000_000.0, True)
    a = ModelConfig.from_hf(_bare("arcee_bias", "rms_norm_eps", "hidden_act"))
    assert (a.hidden_act, a.mlp_bias, a.attention_bias, a.rms_norm_eps, a.nope_layers) == (
        "relu2", True, True, 1e-5, ())
    m = ModelConfig.from_hf(_raw("ministral", attention_bias=True))  # read as transformers: none
    assert (m.layer_types, m.sliding_window, m.attention_bias) == ((SLIDE, FULL), WINDOW, False)
    # MinistralConfig's defaults: every layer within a 4096 window; no window: all full
    m = ModelConfig.from_hf(_bare("ministral", "layer_types", "sliding_window"))
    assert (m.layer_types, m.sliding_window) == ((SLIDE, SLIDE), 4096)
    m = ModelConfig.from_hf({**_bare("ministral", "layer_types"), "sliding_window": None})
    assert (m.layer_types, m.sliding_window) == ((FULL, FULL), None)
    o = ModelConfig.from_hf(_raw("olmo3"))
    assert (o.layer_types, o.sliding_window, o.rope_theta, o.rope_local_theta, o.rms_norm_eps) == (
        (SLIDE, FULL), WINDOW, 500_000.0, 10_000.0, 1e-5)
    # Olmo3Config's defaults: every 4th layer full, a 4096 window, one base 5e5 for both
    o = ModelConfig.from_hf({**_bare("olmo3", "layer_types", "sliding_window", "rope_parameters",
                                     "rms_norm_eps"), "num_hidden_layers": 4})
    assert (o.layer_types, o.sliding_window, o.rope_theta, o.rope_local_theta, o.rms_norm_eps) == (
        (SLIDE, SLIDE, SLIDE, FULL), 4096, 500_000.0, 500_000.0, 1e-5)
    # old-style configs: rope_theta for both kinds, rope_scaling for the full layers only
    o = ModelConfig.from_hf({**_bare("olmo3", "rope_parameters"), "rope_theta": 1e6,
                             "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert (o.rope_theta, o.rope_local_theta, o.rope_scaling.rope_type) == (1e6, 1e6, "linear")
    # Ernie4_5Config's defaults: head_dim 128, base 5e5, eps 1e-5, a tied head; interleaved
    e = ModelConfig.from_hf(_bare("ernie", "head_dim", "rope_parameters", "rms_norm_eps",
                                  "tie_word_embeddings", "use_bias"))
    assert (e.head_dim, e.rope_theta, e.rms_norm_eps, e.tie_word_embeddings, e.rope_interleaved,
            e.attention_bias, e.o_proj_bias) == (128, 500_000.0, 1e-5, True, True, False, False)
    # SeedOssConfig's: q/k/v biased, o_proj not, head_dim 128
    o = ModelConfig.from_hf(_bare("seed_oss", "head_dim", "attention_bias", "attention_out_bias"))
    assert (o.head_dim, o.attention_bias, o.o_proj_bias, o.rope_interleaved) == (
        128, True, False, False)
    o = ModelConfig.from_hf(_raw("seed_oss_out"))
    assert (o.head_dim, o.attention_bias, o.o_proj_bias) == (32, False, True)
    # every other family: o_proj biased with q/k/v, but Qwen2's
    # Exaone4Config's: every 4th layer full (NoPE), a 4096 window, eps 1e-5, no biases
    x = ModelConfig.from_hf({**_bare("exaone4", "layer_types", "sliding_window",
                                     "sliding_window_pattern", "rms_norm_eps"),
                             "num_hidden_layers": 8, "attention_bias": True})
    assert (x.layer_types, x.sliding_window, x.nope_layers, x.rms_norm_eps, x.qk_norm,
            x.attention_bias) == ((SLIDE, SLIDE, SLIDE, FULL) * 2, 4096, (3, 7), 1e-5, True, False)
    x = ModelConfig.from_hf(_raw("exaone4_global"))
    assert (x.layer_types, x.sliding_window, x.nope_layers) == ((FULL, FULL), None, ())
    # HunYuan's alpha rope: a plain one of base theta * alpha ** (d / (d - 2)); absent: 1e4
    h = ModelConfig.from_hf(_raw("hunyuan_alpha"))
    assert h.rope_scaling is None and h.rms_norm_eps == 1e-5
    assert h.rope_theta == pytest.approx(10_000.0 * 1000.0 ** (32 / 30))
    h = ModelConfig.from_hf(_bare("hunyuan", "rope_parameters", "rms_norm_eps"))
    assert (h.rope_theta, h.rope_scaling, h.rms_norm_eps) == (10_000.0, None, 1e-5)
    # ApertusConfig's: xIELU, its llama3 rope where config.json names none, no MLP bias
    a = ModelConfig.from_hf(_bare("apertus", "rope_parameters", "hidden_act", "rms_norm_eps")
                            | {"mlp_bias": True})
    assert (a.hidden_act, a.mlp_bias, a.qk_norm, a.rms_norm_eps, a.rope_theta) == (
        "xielu", False, True, 1e-5, 12_000_000.0)
    assert (a.rope_scaling.rope_type, a.rope_scaling.factor,
            a.rope_scaling.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    raw = _raw("ministral", architectures=["LlamaForCausalLM"], model_type="llama",
               attention_bias=True)
    assert ModelConfig.from_hf(raw).o_proj_bias
    raw.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert not ModelConfig.from_hf(raw).o_proj_bias


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("smollm3", dict(no_rope_layers=[1, 0]), "no_rope_layers must list 1 \\(rotary\\) or 0 "
     "\\(NoPE\\) for each of the 4 layers, got \\[1, 0\\]"),
    ("smollm3", dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must list"),
    ("smollm3", dict(no_rope_layers=None, no_rope_layer_interval=0),
     "no_rope_layer_interval must be a positive integer, got 0"),
    ("smollm3", dict(layer_types=[FULL, SLIDE, FULL, FULL], sliding_window=8),
     "layer_types has sliding_attention layers but use_sliding_window is false"),
    ("smollm3_window", dict(sliding_window=None), "sliding_window must be a positive integer "
     "for SmolLM3ForCausalLM \\(layer_types has sliding_attention layers\\), got None"),
    ("smollm3", dict(mlp_bias=True), "mlp_bias true is not supported for SmolLM3ForCausalLM"),
    ("smollm3", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for SmolLM3"),
    ("smollm3", dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    ("arcee", dict(hidden_act="swish"), "hidden_act 'swish' is not supported for "
     "ArceeForCausalLM \\(supported: .*relu2"),
    ("arcee", dict(mlp_bias=1), "mlp_bias must be true or false, got 1"),
    ("ministral", dict(layer_types=[SLIDE]), "layer_types must list one of sliding_attention, "
     "full_attention for each of the 2 layers"),
    ("ministral", dict(sliding_window=0), "sliding_window must be a positive integer for "
     "MinistralForCausalLM"),
    ("ministral", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for Ministral"),
    ("olmo3", dict(layer_types=[SLIDE, "chunked_attention"]), "layer_types must list"),
    ("olmo3", dict(rope_parameters={SLIDE: {"rope_type": "linear", "factor": 2.0}, FULL: {}}),
     "the sliding layers' rope must be the default one \\(OLMo 3's\\)"),
    ("olmo3", dict(rms_norm_eps=0), "rms_norm_eps must be a positive number, got 0"),
    ("olmo3", dict(intermediate_size=None), r"missing required field\(s\): intermediate_size"),
    ("ernie", dict(use_bias=True), "use_bias true is not supported for Ernie4_5ForCausalLM"),
    ("ernie", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for Ernie4_5"),
    ("seed_oss", dict(mlp_bias=True), "mlp_bias true is not supported for SeedOssForCausalLM"),
    ("seed_oss", dict(attention_out_bias="no"), "attention_out_bias must be true or false"),
    ("seed_oss", dict(head_dim=0), "head_dim must be a positive integer, got 0"),
    ("exaone4", dict(layer_types=None, sliding_window_pattern="LLLG"),
     "sliding_window_pattern must be a positive integer, got 'LLLG'"),
    ("exaone4_global", dict(layer_types=[SLIDE, FULL]), "sliding_window must be a positive "
     "integer for Exaone4ForCausalLM \\(layer_types has sliding_attention layers\\), got None"),
    ("exaone4", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for Exaone4"),
    ("hunyuan", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope type 'dynamic' without an alpha .* is not supported for HunYuanDenseV1ForCausalLM"),
    ("hunyuan", dict(rope_parameters={**ALPHA, "alpha": "big"}),
     "rope alpha must be a positive number, got 'big'"),
    ("hunyuan", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for HunYuan"),
    ("apertus", dict(hidden_act="swish"), "hidden_act 'swish' is not supported for "
     "ApertusForCausalLM \\(supported: xielu, gelu_pytorch_tanh"),
])
def test_bad_config_is_a_clear_error(name, edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_raw(name, **edit))


def test_model_type_alone_names_the_architecture():
    for name in ("smollm3", "arcee", "ministral", "olmo3", "ernie", "seed_oss", "exaone4",
                 "hunyuan", "apertus"):
        raw = _raw(name)
        del raw["architectures"]
        assert ModelConfig.from_hf(raw).architecture == _arch(name)


# ----------------------------------------------------------------------------- GPU
def _gpu_checkpoint(tmp_path: Path, name: str, **overrides) -> Path:
    """head_dim 64, the smallest the Triton attention kernels take."""
    kw = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    if name.startswith(("ministral", "ernie", "seed_oss", "hunyuan")):  # head_dim of their own
        kw["head_dim"] = 64
    return build_tiny(tmp_path / name, name, **{**kw, **overrides})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32_kernels_and_graphs_give_transformers_tokens(tmp_path, name):
    """Our attention (windowed and full), fused rotary + cache-write and plain cache-write
    (SmolLM3's NoPE layers) kernels, eager and in CUDA graphs, against transformers' fp32
    tokens."""
    path = _gpu_checkpoint(tmp_path, name)
    llm = assert_gpu_graphs_match_hf(path, random_prompts(8, 1, 120, seed=28))
    layers = llm.engine.model.model.layers
    assert layers[0].self_attn.rotary_emb.fused
    if name.startswith("smollm3") or name == "exaone4":
        assert layers[1].self_attn.rotary_emb is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_follows_fp32_as_far_as_transformers_bf16(tmp_path, name):
    """bf16 (triton, graphs) against transformers' fp32 tokens, teacher-forced: ours picks
    fp32's token as often as transformers' own bf16 does (conftest's
    bf16_teacher_forced_hits: greedy bf16 runs of a tiny random model part chaotically)."""
    path = _gpu_checkpoint(tmp_path, name)
    prompts = random_prompts(32, 1, 120, seed=11)
    truth = hf_greedy(path, prompts, GREEDY.max_tokens)
    ours16, hf16 = bf16_teacher_forced_hits(path, prompts, truth, attention_backend="triton")
    total = sum(len(t) for t in truth)
    assert ours16 >= hf16 - 0.03 * total and ours16 >= 0.85 * total, (ours16, hf16, total)
