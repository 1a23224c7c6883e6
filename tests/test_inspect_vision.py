"""``flashpage inspect`` on image models (inspect.vision_figures): the tower and projector's
parameters are those the engine loads, one image's prompt tokens those the engine's
preprocessing makes of it (tiny LLaVA, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Mistral3, Gemma 3, InternVL, Idefics3, SmolVLM and GLM-4.1V checkpoints, several sizes), and the tokens left after the weights take the tower's bytes
too; the published configs' figures where they are known (LLaVA-1.5: 576 rows of 24 x 24
patches); a bad --image-size is a clear error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from flashpage import LLM
from flashpage.config import ModelConfig
from flashpage.inspect import inspect_config, main, parse_image_size
from tests.gemma3_checkpoint import build_tiny_gemma3
from tests.glm4v_checkpoint import build_tiny_glm4v, hf_glm4v
from tests.idefics3_checkpoint import build_tiny_idefics3
from tests.internvl_checkpoint import build_tiny_internvl
from tests.llava_checkpoint import build_tiny_llava
from tests.llava_next_checkpoint import build_tiny_llava_next
from tests.llava_onevision_checkpoint import build_tiny_llava_onevision
from tests.pixtral_checkpoint import build_tiny_pixtral
from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl, hf_qwen3_vl

ROOT = Path(__file__).resolve().parents[1]
BUILDERS = {
    "llava": build_tiny_llava,
    "llava_next": build_tiny_llava_next,
    "llava_onevision": build_tiny_llava_onevision,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen2_5_vl": lambda p: build_tiny_qwen2_vl(p, variant="qwen2_5_vl"),
    "qwen3_vl": build_tiny_qwen3_vl,
    "mistral3": build_tiny_pixtral,
    "gemma3": build_tiny_gemma3,
    "internvl": build_tiny_internvl,
    "idefics3": build_tiny_idefics3,
    "smolvlm": lambda p: build_tiny_idefics3(p, smolvlm=True, splitting=False),
    "glm4v": build_tiny_glm4v,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend="torch_native", block_size=8)
    return request.param, path, llm


@pytest.mark.parametrize("size", [(64, 48), (30, 90), (17, 17)])
def test_image_tokens_are_the_engines(tiny, size):
    name, path, llm = tiny
    info = inspect_config(ModelConfig.from_hf(str(path)), 1 << 30, "fp32", image_size=size)
    enc = llm.engine.mm_encoder
    token = getattr(enc, "placeholder_ids", None)
    ids = [1, 5, *(token or [enc.config.image_token_id]), 6]
    expanded, inputs = enc.prepare(ids, {"image": Image.new("RGB", size, (90, 120, 200))})
    if name in ("idefics3", "smolvlm"):  # one input per tile (apart in the prompt): the whole expansion
        assert all(i.length == enc.config.tokens_per_image for i in inputs)
        rows = len(expanded) - len(ids) + 1
    else:
        assert len(inputs) == 1
        rows = inputs[0].length
    assert info["vision"]["image_tokens"] == rows > 0
    assert info["vision"]["image_size"] == list(size)
    assert info["vision"]["kv_bytes_per_image"] == rows * info["kv_bytes_per_token"]


def test_tower_parameters_and_bytes(tiny):
    name, path, llm = tiny
    cfg = ModelConfig.from_hf(str(path))
    info = inspect_config(cfg, 1 << 30, "bf16")
    if name == "qwen3_vl":  # the tower with its deepstack mergers, transformers' count
        want = sum(p.numel() for p in hf_qwen3_vl(path).model.visual.parameters())
        assert want == sum(p.numel() for p in llm.engine.mm_encoder.parameters())
    elif name.startswith("qwen"):  # ours fuses (and pads) gate / up once loaded: count transformers'
        from tests.qwen2_vl_checkpoint import hf_qwen

        want = sum(p.numel() for p in hf_qwen(path, name).model.visual.parameters())
    elif name == "glm4v":  # (its blocks' and merger's gate / up fused and padded too)
        want = sum(p.numel() for p in hf_glm4v(path).model.visual.parameters())
    else:
        want = sum(p.numel() for p in llm.engine.mm_encoder.parameters())
    assert info["vision"]["params"] == want
    assert info["vision"]["bytes"] == 2 * want
    # the tower's bytes come off the memory left to the KV cache
    without = (info["memory_bytes"] - info["weights_bytes"]) // info["kv_bytes_per_token"]
    assert info["tokens_in_memory_after_weights"] == (
        info["memory_bytes"] - info["weights_bytes"] - 2 * want) // info["kv_bytes_per_token"] < without


def test_published_llava_and_text_models():
    cfg = ModelConfig.from_hf(str(ROOT / "benchmarks" / "configs" / "llava-1.5-7b"))
    info = inspect_config(cfg, 80 << 30)
    assert info["vision"]["image_tokens"] == 576  # (336 / 14)^2, whatever the image's size
    assert 0.30e9 < info["vision"]["params"] < 0.33e9  # CLIP ViT-L/14 (its last layer unread) + MLP
    qwen = inspect_config(ModelConfig.from_hf(str(ROOT / "benchmarks" / "configs" / "qwen2.5-vl-7b")),
                          80 << 30, image_size=(1024, 768))
    assert qwen["vision"]["image_tokens"] == (1036 // 28) * (756 // 28)  # smart_resize to 28s
    text = inspect_config(ModelConfig.from_hf(str(ROOT.parent / "shared" / "configs" / "llama-3-8b")), 80 << 30)
    assert text["vision"] is None
    gemma = inspect_config(ModelConfig.from_hf(str(ROOT / "tests" / "models" / "configs" / "gemma-3-4b-it")),
                           80 << 30)
    assert gemma["vision"]["image_tokens"] == 256  # mm_tokens_per_image, whatever the image's size
    assert 0.40e9 < gemma["vision"]["params"] < 0.43e9  # SigLIP-So400m (its pooling head unread) + projector


def test_published_qwen3_vl():
    """Qwen3-VL-4B's config.json and preprocessor_config.json: a 1024 x 768 image is 32 x 24
    merged units of 32 pixels; the tower with its three deepstack mergers and the text model
    are transformers' 415,347,712 and 4,022,468,096 parameters (its meta-device model's
    counts)."""
    info = inspect_config(ModelConfig.from_hf(str(ROOT / "benchmarks" / "configs" / "qwen3-vl-4b")),
                          80 << 30, image_size=(1024, 768))
    assert info["vision"]["image_tokens"] == (1024 // 32) * (768 // 32)
    assert info["vision"]["params"] == 415_347_712
    assert info["param_count"] == 4_022_468_096  # the text model (Qwen3, tied): transformers' too


def test_published_glm4v():
    """GLM-4.1V-9B-Thinking's config.json and preprocessor_config.json: a 1024 x 768 image is
    37 x 27 merged units of 28 pixels (under max_pixels counted as two frames); the tower and
    the text model are transformers' 892,498,432 and 9,400,279,040 parameters (its
    meta-device model's counts); rotary on 64 of each head's 128 dims."""
    info = inspect_config(ModelConfig.from_hf(str(ROOT / "benchmarks" / "configs" / "glm-4.1v-9b-thinking")),
                          80 << 30, image_size=(1024, 768))
    assert info["multimodal_architecture"] == "Glm4vForConditionalGeneration"
    assert info["vision"]["image_tokens"] == 37 * 27
    assert info["vision"]["params"] == 892_498_432
    assert info["param_count"] == 9_400_279_040
    assert (info["head_dim"], info["rotary_dim"], info["rotary_interleaved"]) == (128, 64, True)
    assert info["kv_bytes_per_token"] == 40 * 2 * 2 * 128 * 2  # 40 layers, K and V of 2 heads, bf16


def test_cli_image_size(capsys):
    cfg = str(ROOT / "benchmarks" / "configs" / "qwen2.5-vl-7b")
    assert main([cfg, "--image-size", "448x448", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vision"]["image_tokens"] == 256
    assert main([cfg, "--image-size", "448x448"]) == 0
    assert "one 448x448 image" in capsys.readouterr().out
    assert main([cfg, "--image-size", "448"]) == 2
    assert "WIDTHxHEIGHT" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive"):
        parse_image_size("0x10")


def test_published_qwen2_audio(capsys):
    """Qwen2-Audio-7B-Instruct's config.json and preprocessor_config.json (written from the
    published files' fields): the encoder and projector, and the text model (Qwen2, untied),
    are transformers' 642,215,936 and 7,754,878,976 parameters (its meta-device model's
    counts); a 30 s audio, the longest, is 750 prompt tokens; the report names them."""
    path = str(ROOT / "tests" / "models" / "configs" / "qwen2-audio-7b-instruct")
    info = inspect_config(ModelConfig.from_hf(path), 80 << 30)
    assert info["audio_input"] and info["vision"] is None and not info["image_input"]
    assert info["audio"]["params"] == 642_215_936
    assert info["audio"]["max_audio_tokens"] == 750 and info["audio"]["tokens_per_second"] == 25
    assert info["param_count"] == 7_754_878_976
    assert info["tokens_in_memory_after_weights"] == (
        (80 << 30) - info["weights_bytes"] - info["audio"]["bytes"]) // info["kv_bytes_per_token"]
    assert main([path]) == 0
    out = capsys.readouterr().out
    assert "its text model and audio input" in out and "750 prompt tokens" in out
