"""Every benchmark script at least imports and parses its arguments on a machine without a
GPU, so a broken import is found here, not in the GPU budget of the next session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "gpu_timing.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_and_parses_arguments(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-2000:]
    # Either its help, or (GPU-only scripts) a one-line refusal that says why.
    assert r.returncode == 0 or "needs a CUDA GPU" in out, out[-2000:]


def test_fused_moe_gpt_oss_runs_in_the_interpreter(tmp_path):
    """benchmarks/fused_moe.py --model gpt-oss-20b on the CPU (tiny shapes, the Triton
    interpreter): every path, the MXFP4 ones included, runs and agrees with sync-free."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--model",
                        "gpt-oss-20b", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    rows = json.loads((tmp_path / "fused_moe_gpt-oss-20b.json").read_text())["rows"]
    paths = {row["path"].split(" (")[0] for row in rows}
    assert {"fused", "fused mxfp4", "torch grouped, mxfp4 dequantized", "torch grouped"} <= paths
    assert not [row for row in rows if "error" in row]
    assert all(row["max_diff_vs_sync_free"] < 1e-4 for row in rows)
    mx = [row for row in rows if "mxfp4" in row["path"]]
    assert mx and all(row["eager_us"] > 0 for row in mx)
    assert "fused mxfp4" in (tmp_path / "fused_moe_gpt-oss-20b.md").read_text()


def test_fused_moe_fp8_runs_in_the_interpreter(tmp_path):
    """benchmarks/fused_moe.py --fp8 on the CPU (a tiny stand-in for Qwen3-30B-A3B's
    experts, the Triton interpreter): the bf16 kernel, the fp8 kernel's default and each of
    its modes (the swapped W8A8 form among them) run; weight-only equals the bf16 kernel on the dequantized weights to fp32's
    order, W8A8 within e4m3's rounding (coarser here: the interpreter's own fp8 casts)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--fp8",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    rows = json.loads((tmp_path / "fused_moe_fp8.json").read_text())["rows"]
    assert not [row for row in rows if "error" in row]
    names = [row["path"] for row in rows]
    assert len(names) == 11 and names[0].startswith("bf16 fused")
    # the swapped form's modes: on fp16 wgmmas at 16 and 32 rows, on e4m3 ones at 16 and 32
    # rows and with gate_up quantizing the activation
    assert sum(" swap m" in n for n in names) == 2
    assert sum(" swap e4m3 m" in n for n in names) == 3
    assert all(row["eager_us"] > 0 for row in rows)
    for row in rows[1:]:
        assert row["needed_mb"] < rows[0]["needed_mb"]  # a byte a weight against two
        assert row["rel_diff_vs_bf16"] < (0.3 if "w8a8 gu" in row["path"] else 1e-5), row
    assert "fp8 w8a16" in (tmp_path / "fused_moe_fp8.md").read_text()


def test_fp8_block_sweep_runs_in_the_interpreter(tmp_path):
    """benchmarks/fp8_block_gemm.py --sweep on the CPU (tiny shapes, the Triton interpreter):
    every W8A8 candidate tile and the default are timed at each shape and row count beside
    the baselines, each tile's product within fp32 rounding of the emulation, and the JSON
    names the fastest tile of each."""
    import json

    from flashpage.kernels.fp8_block_gemm import W8A8_CANDIDATES

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_block_gemm.py"), "--sweep",
                        "--shapes", "o_proj,down", "--rows", "8,70", "--json-out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    res = json.loads(out.read_text())
    assert res["sweep"] and res["seconds"] > 0
    names = {c.name for c in W8A8_CANDIDATES}
    for shape in ("o_proj", "down"):
        for m in (8, 70):
            rows = [row for row in res["rows"] if row["shape"] == shape and row["rows"] == m]
            assert {row["config"] for row in rows} - {None} == names
            assert {"quant", "bf16"} <= {row["kernel"] for row in rows}
            assert all(row["rel_err"] < 1e-5 and row["us"] > 0 for row in rows if row["config"])
            best = res["best"][shape][str(m)]
            assert best["config"] in names
            assert best["us"] == min(row["us"] for row in rows if row["config"])


def test_fused_moe_int4_runs_in_the_interpreter(tmp_path):
    """benchmarks/fused_moe.py --int4 on the CPU (a tiny stand-in for Qwen3-30B-A3B's
    experts, groups of 128, the Triton interpreter): the bf16 kernel, the int4 kernel's
    default and its tiles run, each equal to the bf16 kernel on the dequantized weights to
    fp32's order, each reading fewer bytes."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--int4",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    rows = json.loads((tmp_path / "fused_moe_int4.json").read_text())["rows"]
    assert not [row for row in rows if "error" in row]
    names = [row["path"] for row in rows]
    assert len(names) >= 4 and names[0].startswith("bf16 fused")
    assert names[1].startswith("int4 fused (default")
    assert all(row["eager_us"] > 0 for row in rows)
    for row in rows[1:]:
        assert row["needed_mb"] < rows[0]["needed_mb"] / 3  # half a byte a weight against two
        assert row["rel_diff_vs_bf16"] < 1e-5, row
    assert "MoE experts in int4" in (tmp_path / "fused_moe_int4.md").read_text()


def _vlm_module():
    """benchmarks/vlm.py as a module (in this process: no second import of torch)."""
    import importlib.util

    if "bench_vlm" in sys.modules:
        return sys.modules["bench_vlm"]
    spec = importlib.util.spec_from_file_location("bench_vlm", ROOT / "benchmarks" / "vlm.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_vlm"] = mod  # (its dataclass looks its module up there)
    spec.loader.exec_module(mod)
    return mod


def _tiny_glm4v_config(path: Path) -> Path:
    """A tiny GLM-4.1V config folder (config.json and the image processor's file, no weights,
    no tokenizer: what vlm.py's random-weights runs read); its special ids 250-255."""
    import json

    import transformers

    ids = dict(image_start_token_id=250, image_token_id=251, image_end_token_id=252, video_start_token_id=253,
               video_token_id=254, video_end_token_id=255)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024, partial_rotary_factor=0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "partial_rotary_factor": 0.5})
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, image_size=56,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    transformers.Glm4vConfig(text_config=text, vision_config=vision, eos_token_id=2, **ids).save_pretrained(path)
    transformers.Glm4vImageProcessorPil(size={"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * 28 * 28 * 24}
                                        ).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Glm4vForConditionalGeneration"]}))
    return path


def _tiny_qwen2_audio_config(path: Path) -> Path:
    """A tiny Qwen2-Audio config folder: 16 mel bins, 1 s chunks (100 frames, 50 encoder
    positions), <|AUDIO|> 250; no weights, no tokenizer."""
    import json

    import transformers

    transformers.Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          num_mel_bins=16, max_source_positions=50),
        text_config=dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=2),
        audio_token_index=250).save_pretrained(path)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2AudioForConditionalGeneration"]}))
    return path


def _tiny_smolvlm_config(path: Path) -> Path:
    """A tiny SmolVLM config folder: 16 x 16 tiles of 2 x 2 patches pixel-shuffled by 2 (16
    rows a tile), the longest edge resized to 32 (2 x 2 tiles and the global one), <image>
    250; no weights, no tokenizer (vlm.py writes the processor's tokens)."""
    import json

    import transformers

    text = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=2)
    transformers.SmolVLMConfig(text_config=text, vision_config=vision, image_token_id=250,
                               scale_factor=2).save_pretrained(path)
    transformers.SmolVLMImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16}
                                          ).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 16, "processor_class": "SmolVLMProcessor"}))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["SmolVLMForConditionalGeneration"]}))
    return path


# family: (its tiny config, vlm.py's own flags, its modality, rows an input, prompt tokens a request)
_VLM_FAMILIES = {
    # a 56 x 56 image: 4 x 4 patches merged 2 x 2; <|begin_of_image|> and <|end_of_image|> around
    "glm4v": (_tiny_glm4v_config, ["--image-size", "56"], "image", 4, 4 + 2),
    # 0.5 s at 16 kHz: 50 mel frames -> 25 positions -> 12 rows; <|audio_bos|> / <|audio_eos|>
    # (no tokenizer: the ids after <|AUDIO|>'s) around them
    "qwen2_audio": (_tiny_qwen2_audio_config, ["--audio-seconds", "0.5"], "audio", 12, 12 + 2),
    # 5 tiles of 16 rows, each <fake_token_around_image><row_r_col_c> (the global one's
    # <global-img>) before its rows; "\n" after the first tile row, "\n\n" after the grid,
    # <fake_token_around_image> at the end
    "smolvlm": (_tiny_smolvlm_config, ["--image-size", "16"], "image", 80, 5 * 18 + 2 + 1),
}


@pytest.mark.parametrize("family", list(_VLM_FAMILIES))
def test_vlm_drives_the_newer_families_on_the_cpu(family, tmp_path, monkeypatch):
    """benchmarks/vlm.py end to end on tiny random GLM-4.1V, Qwen2-Audio and SmolVLM configs
    (fp32, CPU): every request runs, transformers' own class generates on the prompts and
    inputs our preprocessing makes (it refuses rows that do not match its features), both
    towers are timed, and the JSON holds the family's rows and prompt lengths (BOS, 8 shared
    tokens, the input's, 4 own)."""
    import json

    build, extra, modality, rows, input_tokens = _VLM_FAMILIES[family]
    vlm = _vlm_module()
    out = tmp_path / "vlm.json"
    monkeypatch.setattr(sys, "argv", [
        "vlm.py", "--config", str(build(tmp_path / family)), "--requests", "3", "--hf-requests", "2",
        "--hf-batch-size", "2", "--tower-batch", "2", "--output-len", "2", "--system", "8", "--question", "4",
        "--dtype", "float32", *extra, "--json-out", str(out)])
    vlm.main()
    r = json.loads(out.read_text())
    ours = r["flashpage"]
    assert ours["output_tokens"] == 3 * 2 and r["transformers"]["output_tokens"] == 2 * 2
    assert r["tower"]["ours"] > 0 and r["tower"]["transformers"] > 0 and r["text_twin"]["output_tok_per_s"] > 0
    assert ours["encode_calls"] >= 1
    assert r["modality"] == modality and ours[f"rows_per_{modality}"] == rows
    assert ours["prompt_tokens_each"] == 1 + 8 + input_tokens + 4
    if modality == "audio":
        assert "mask" in r["tower"]["transformers_path"]


@pytest.mark.parametrize("kind", ["bidirectional", "additive"])
def test_vlm_audio_tower_path_is_transformers_forward(kind, tmp_path, monkeypatch):
    """vlm.py's transformers audio tower + projector (hf_audio_features, timed as its encoder
    alone) gives the rows Qwen2AudioModel.forward merges into the prompt, with either mask
    (the forward's of this transformers, or the -inf one of earlier versions): audios of two
    lengths in one batch; without the mask the shorter one's rows differ."""
    import types

    import torch
    import transformers

    from flashpage.models.qwen2_audio_config import AudioFeatures

    vlm = _vlm_module()
    cfg = transformers.AutoConfig.from_pretrained(_tiny_qwen2_audio_config(tmp_path / "audio"))
    torch.manual_seed(0)
    hf = transformers.Qwen2AudioForConditionalGeneration(cfg).eval()
    enc = types.SimpleNamespace(config=types.SimpleNamespace(features=AudioFeatures(feature_size=16, chunk_length=1)))
    g = torch.Generator().manual_seed(0)
    waves = [torch.from_numpy(vlm.random_audio(g, s)) for s in (0.5, 0.3)]
    kw = vlm.hf_media_kwargs(hf, [vlm.hf_audio(enc, w) for w in waves], torch.device("cpu"))
    assert kw["feature_attention_mask"].sum(-1).tolist() == [50, 30]
    rows = [12, 7]  # 50 mel frames -> 25 positions -> 12 rows; 30 -> 15 -> 7
    ids = torch.tensor([[5, *[250] * 12], [5, *[6] * 5, *[250] * 7]])
    seen = []
    hook = hf.model.multi_modal_projector.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        with torch.no_grad():
            hf(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    finally:
        hook.remove()
    monkeypatch.setattr(vlm, "hf_audio_mask_kind", lambda hf: kind)
    with torch.no_grad():
        got = vlm.hf_audio_features(hf, **kw)
        unmasked = hf.model.multi_modal_projector(hf.model.audio_tower(kw["input_features"]).last_hidden_state)
    for i, n in enumerate(rows):
        torch.testing.assert_close(got[i, :n], seen[0][i, :n], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[1, :7], seen[0][1, :7], rtol=1e-3, atol=1e-3)
