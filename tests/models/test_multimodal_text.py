"""The text model of multimodal checkpoints (models/multimodal.py, config._text_config_of):
Gemma3ForConditionalGeneration's text model (its images: tests/models/test_gemma3_vision.py),
Llama4ForConditionalGeneration served text-only, and
Mistral3ForConditionalGeneration's text model on text-only prompts (its images:
tests/engine/test_pixtral_engine.py).

CPU, fp32: tiny random checkpoints saved by transformers' own ConditionalGeneration classes
(tiny vision towers too); our greedy tokens equal the ConditionalGeneration model's own
generate on text-only input ids, under either prefix layout (transformers 4's
``language_model.model.`` as transformers 5 still saves, and transformers 5's module names
``model.language_model.`` / ``lm_head`` / ``model.vision_tower``); the vision tensors are
skipped with one INFO line counting them, a stray tensor is an error naming it;
``flashpage inspect`` counts the text model's parameters (tiny: the file's language-model
tensors; gemma-3-4b-it's, Llama-4-Scout's and Mistral-Small-3.1's config.json: transformers'
text model on the meta device) and says it runs text-only; the config's fields (text_config
with its class's defaults, the top-level fields) and errors.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import transformers

from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import format_report, inspect_config, param_counts
from flashpage.models.loader import ModelLoadError, iter_safetensors, load_model, resolve_model
from flashpage.models.multimodal import vision_prefixes
from tests.conftest import _checkpoints, cpu_greedy, edited_copy, random_prompts

CONFIGS = Path(__file__).parent / "configs"
WINDOW = 8  # Gemma 3's sliding window / Llama 4's chunk: the prompts run past it
_GEMMA_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                   eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
                   query_pre_attn_scalar=4,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_scaling={"rope_type": "linear", "factor": 2.0})
_LLAMA4_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=32,
                    intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    no_rope_layer_interval=2, interleave_moe_layer_step=2,
                    attention_chunk_size=WINDOW, floor_scale=4, attn_scale=0.5,
                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MISTRAL_TEXT = dict(model_type="mistral", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512, sliding_window=None,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
# name -> (transformers config class, model class, config kwargs)
TINY: dict[str, tuple[str, str, dict]] = {
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=_GEMMA_TEXT, mm_tokens_per_image=4, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14))),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", dict(
        text_config=_LLAMA4_TEXT, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14, vision_output_dim=64, projector_input_dim=64,
            projector_output_dim=64, pixel_shuffle_ratio=0.5))),
    # transformers 5 ties Mistral3's head by the top-level flag (default true): untied here,
    # as Mistral Small 3.1's checkpoint is
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        text_config=_MISTRAL_TEXT, tie_word_embeddings=False, vision_config=dict(
            model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, head_dim=16, image_size=28, patch_size=14))),
}
NAMES = sorted(TINY)
EAGER = dict(attn_implementation="eager")  # Gemma 3's windows, as test_gemma.py compares


def build_tiny(path: Path, name: str, seed: int = 0) -> Path:
    """transformers' ConditionalGeneration model of ``TINY[name]``, saved as fp32
    safetensors: the language model's weights widened as the family tests widen theirs
    (Gemma's norm weights w in [-0.5, 0.5] around its 1 + w and embeddings of std 0.02;
    the others' norms in [0.5, 1.5]; Llama 4's routers of std 0.5), the vision tower's as
    transformers initializes them."""
    cfg_cls, model_cls, kwargs = TINY[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "language_model" not in n:
                continue
            if name == "gemma3" and "norm" in n:
                p.uniform_(-0.5, 0.5)
            elif name == "gemma3" and "embed" in n:
                p.normal_(0, 0.02)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "router" in n:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny)


def _prompts() -> list[list[int]]:
    # never Mistral3's [IMG] (10): a prompt with it and no image is refused
    return [[11 if t == 10 else t for t in p] for p in random_prompts(3, 3 * WINDOW, 36, seed=2)]


def hf_conditional_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int
                          ) -> list[list[int]]:
    """The ConditionalGeneration model's own greedy generate on text-only input ids (fp32,
    CPU, eager attention, one prompt at a time, EOS ignored)."""
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32, **EAGER)
    if arch == "Llama4ForConditionalGeneration":
        # transformers 5.24's forward ends in an AttributeError (it reads ``image_outputs``
        # off its language model's MoeCausalLMOutputWithPast); on text-only ids it is its
        # ``language_model`` (a Llama4ForCausalLM, loaded by the wrapper) over the same
        # embeddings, so that runs instead
        model = model.language_model
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def _v5_names(name: str) -> str:
    """A file's tensor name under transformers 5's module names."""
    for old, new in (("language_model.model.", "model.language_model."),
                     ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("vision_model.", "model.vision_model."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    raise AssertionError(name)


def _rename_all(tensors: dict[str, torch.Tensor]) -> None:
    for n in list(tensors):
        tensors[_v5_names(n)] = tensors.pop(n)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_conditional_generation(tiny, name, tmp_path):
    path = tiny(name)
    ref = hf_conditional_greedy(path, _prompts(), 12)
    assert cpu_greedy(path, _prompts()) == ref
    # the same weights under transformers 5's module names
    v5 = edited_copy(path, tmp_path / "v5", edit=_rename_all)
    assert cpu_greedy(v5, _prompts()) == ref


@pytest.mark.parametrize("name", NAMES)
def test_the_config_is_the_text_models(tiny, name):
    cfg = ModelConfig.from_hf(tiny(name))
    text_arch = {"gemma3": "Gemma3ForCausalLM", "llama4": "Llama4ForCausalLM",
                 "mistral3": "MistralForCausalLM"}[name]
    assert (cfg.architecture, cfg.multimodal_architecture) == (text_arch, TINY[name][1])
    assert (cfg.vocab_size, cfg.hidden_size) == (256, 64)
    assert cfg.torch_dtype == "float32"  # the top level's dtype
    assert cfg.tie_word_embeddings == (name == "gemma3")
    if name == "gemma3":
        assert [cfg.attention_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
        assert cfg.query_pre_attn_scalar == 4 and cfg.qk_norm
    if name == "llama4":
        assert cfg.attention_chunk_size == WINDOW and cfg.nope_layers == (1, 3)


@pytest.mark.parametrize("name", NAMES)
def test_vision_tensors_are_skipped_and_counted(tiny, name, caplog):
    path = tiny(name)
    names = [n for n, _ in iter_safetensors(str(path))]
    source = resolve_model(str(path))
    vision = [n for n in names if n.startswith(vision_prefixes(source.config))]
    assert len(vision) >= 10 and len(vision) < len(names)
    with caplog.at_level(logging.INFO, logger="flashpage.models.multimodal"):
        model = load_model(source, torch.float32, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.name == "flashpage.models.multimodal"]
    what = {"mistral3": "and its images (vision tower and projector: models/pixtral.py)",
            "gemma3": "and its images (vision tower and projector: models/gemma3_vision.py)"
            }.get(name, "only; image inputs are not supported")
    assert lines == [f"{TINY[name][1]}: its text model ({source.config.architecture}) {what}; "
                     f"skipped {len(vision)} vision tower / projector tensor(s) of the checkpoint"]
    assert not any("vision" in n or "projector" in n for n, _ in model.named_parameters())


def test_a_stray_tensor_is_an_error_naming_it(tiny, tmp_path):
    def add(t):
        t["audio_tower.proj.weight"] = torch.zeros(2, 2)

    path = edited_copy(tiny("mistral3"), tmp_path / "stray", edit=add)
    with pytest.raises(ModelLoadError, match=r"'audio_tower\.proj\.weight' is neither the "
                                             r"language model's .* nor a vision module's"):
        load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))

    def drop(t):
        del t["language_model.model.layers.1.mlp.up_proj.weight"]

    path = edited_copy(tiny("mistral3"), tmp_path / "missing", edit=drop)
    with pytest.raises(ModelLoadError, match=r"1 weight\(s\) missing .*layers\.1\.mlp\.up_proj"):
        load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_the_text_models_parameters(tiny, name):
    path = tiny(name)
    cfg = ModelConfig.from_hf(path)
    skip = vision_prefixes(cfg)
    stored = sum(t.numel() for n, t in iter_safetensors(str(path)) if not n.startswith(skip))
    total, active = param_counts(cfg)
    assert total == stored
    assert (total == active) == (name != "llama4")
    report = format_report(inspect_config(cfg, 1 << 30))
    what = r"and image input \(the vision tower" if name in ("mistral3", "gemma3") else \
        r"only \(image inputs are not supported"
    assert re.search(rf"multimodal +{TINY[name][1]}: its text model {what}", report), report


def test_inspect_cli_on_a_config_json(capsys):
    from flashpage.inspect import main

    assert main([str(CONFIGS / "gemma-3-4b-it" / "config.json"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Gemma3ForCausalLM"
    assert info["multimodal_architecture"] == "Gemma3ForConditionalGeneration"
    assert info["image_input"] is True  # its images run (models/gemma3_vision.py)
    assert main([str(CONFIGS / "llama-4-scout-17b-16e-instruct")]) == 0
    out = capsys.readouterr().out
    assert "Llama4ForConditionalGeneration: its text model only" in out
    assert "107.770 B (17.173 B active per token)" in out


# the published config.json's text_config -> transformers' text model class, its parameters
# in billions (rounded), KV bytes a token in bf16 (2 x KV heads x head_dim x 2 B a layer)
FULL_SIZE = {
    "gemma-3-4b-it": ("Gemma3TextConfig", 3.880, 34 * 2 * 4 * 256 * 2),
    "llama-4-scout-17b-16e-instruct": ("Llama4TextConfig", 107.770, 48 * 2 * 8 * 128 * 2),
    "mistral-small-3.1-24b-instruct": ("MistralConfig", 23.572, 40 * 2 * 8 * 128 * 2),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_inspect_full_size_text_models_against_transformers(name):
    """The released shapes: our count from config.json alone equals transformers' text
    model (its class's defaults filling the text_config, as transformers reads it) built on
    the meta device; the KV bytes a token."""
    cls, billions, kv = FULL_SIZE[name]
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    text = {k: v for k, v in raw["text_config"].items() if k != "model_type"}
    if "attn_temperature_tuning" in text:  # Scout's file says 4; transformers 5 wants a bool
        text["attn_temperature_tuning"] = bool(text["attn_temperature_tuning"])
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    hf_cfg = getattr(transformers, cls)(**text)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    info = inspect_config(ModelConfig.from_hf(CONFIGS / name), 80 * 2**30)
    assert info["param_count"] == hf.num_parameters()
    assert info["param_count"] / 1e9 == pytest.approx(billions, abs=5e-4)
    assert info["kv_bytes_per_token"] == kv
    assert info["multimodal_architecture"] == raw["architectures"][0]


def test_gemma_text_config_defaults_and_top_level_fields():
    """gemma-3-4b-it's text_config names 6 fields: the rest are Gemma3TextConfig's
    defaults; the top level's eos_token_id and dtype are the whole model's."""
    cfg = ModelConfig.from_hf(CONFIGS / "gemma-3-4b-it")
    hf = transformers.Gemma3TextConfig()
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2560, 10240, 34)
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 131072
    assert cfg.eos_token_id == (1, 106) and cfg.torch_dtype == "bfloat16"
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert [cfg.attention_window(i) for i in range(6)] == [1024] * 5 + [None]
    # no architectures: the model_type names the wrapper
    raw = json.loads((CONFIGS / "gemma-3-4b-it" / "config.json").read_text())
    del raw["architectures"]
    assert ModelConfig.from_hf(raw).multimodal_architecture == "Gemma3ForConditionalGeneration"


def test_tie_word_embeddings_top_level_first():
    raw = json.loads((CONFIGS / "mistral-small-3.1-24b-instruct" / "config.json").read_text())
    assert not ModelConfig.from_hf(raw).tie_word_embeddings  # MistralConfig's default
    assert ModelConfig.from_hf({**raw, "tie_word_embeddings": True}).tie_word_embeddings
    raw["text_config"]["tie_word_embeddings"] = True
    assert ModelConfig.from_hf(raw).tie_word_embeddings
    assert not ModelConfig.from_hf({**raw, "tie_word_embeddings": False}).tie_word_embeddings


def _edited(name: str, top: dict | None = None, text: dict | None = None) -> dict:
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    raw.update(top or {})
    raw["text_config"] = {**raw["text_config"], **(text or {})} if raw.get("text_config") else None
    return raw


@pytest.mark.parametrize("raw, match", [
    (_edited("gemma-3-4b-it", text={"model_type": "gemma2"}),
     r"text_config\.model_type 'gemma2' is not supported in Gemma3ForConditionalGeneration"),
    (_edited("mistral-small-3.1-24b-instruct", text={"model_type": "ministral3"}),
     r"'ministral3' is not supported in Mistral3ForConditionalGeneration \(supported: "
     r"mistral, ministral\)"),
    (_edited("gemma-3-4b-it", top={"text_config": None}), "needs a text_config object"),
    (_edited("llama-4-scout-17b-16e-instruct", top={"quantization_config": {
        "quant_method": "fbgemm_fp8"}}), r"quantized Llama4ForConditionalGeneration checkpoints"),
    # the text model's own errors name text_config
    (_edited("llama-4-scout-17b-16e-instruct", text={"attention_chunk_size": 0}),
     r"config: text_config: attention_chunk_size must be a positive integer"),
    (_edited("gemma-3-4b-it", text={"hidden_activation": "relu"}),
     r"text_config: hidden_activation 'relu' is not supported"),
])
def test_config_errors_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(raw)


def test_unsupported_wrapper_lists_the_text_only_ones():
    with pytest.raises(ConfigError, match=r"with image input: Gemma3ForConditionalGeneration, "
                                          r"Glm4vForConditionalGeneration, "
                                          r"Glm4vMoeForConditionalGeneration, "
                                          r"Idefics3ForConditionalGeneration, "
                                          r"InternVLChatModel, "
                                          r"InternVLForConditionalGeneration, "
                                          r"LlavaForConditionalGeneration, "
                                          r"LlavaNextForConditionalGeneration, "
                                          r"LlavaOnevisionForConditionalGeneration, "
                                          r"Mistral3ForConditionalGeneration, "
                                          r"Qwen2VLForConditionalGeneration, "
                                          r"Qwen2_5_VLForConditionalGeneration, "
                                          r"Qwen3VLForConditionalGeneration, "
                                          r"Qwen3VLMoeForConditionalGeneration, "
                                          r"SmolVLMForConditionalGeneration; "
                                          r"with audio input: Qwen2AudioForConditionalGeneration; "
                                          r"their text model alone: "
                                          r"Llama4ForConditionalGeneration$"):
        ModelConfig.from_hf({"architectures": ["PaliGemmaForConditionalGeneration"],
                             "text_config": {"model_type": "gemma"}})


def test_llm_chat_refuses_an_image_part(tiny):
    """LLM.chat: an image part is a ValueError naming it (a chat template would render it as
    image placeholder tokens with no image behind them), before any template is applied."""
    from tests.conftest import cpu_llm

    llm = cpu_llm(tiny("llama4"))  # served as its text model alone
    conv = [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ValueError, match=r"message 0: content part 1 has type 'image_url': "
                                         r"only text parts are supported"):
        llm.chat(conv)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_hf_overrides_reach_the_text_config(tiny):
    """vLLM's hf_overrides go over config.json's top level: a text_config dict merges into
    the text model's fields."""
    cfg = ModelConfig.from_hf(tiny("gemma3"), hf_overrides={"text_config": {"sliding_window": 5}})
    assert [cfg.attention_window(i) for i in range(3)] == [5, None, 5]
    assert cfg.multimodal_architecture == "Gemma3ForConditionalGeneration"


def test_mistral3_over_a_ministral_text_config():
    raw = _edited("mistral-small-3.1-24b-instruct", text={
        "model_type": "ministral", "num_hidden_layers": 2, "sliding_window": 4096,
        "layer_types": ["sliding_attention", "full_attention"]})
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.architecture, cfg.multimodal_architecture) == (
        "MinistralForCausalLM", "Mistral3ForConditionalGeneration")
    assert [cfg.attention_window(i) for i in range(2)] == [4096, None]
