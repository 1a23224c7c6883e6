"""quantization="int4" / "rtn": a 16-bit checkpoint's linears rounded to int4 groups at load
(layers/quant.py, layers/linear.quantize_int4, models/int4_formats.quantize_int4).

The reference is the same checkpoint with each linear's weight replaced by what the
quantizer keeps ((q - z) * s, fp32, per group along K, the group ``int4_group_for`` picks):
transformers over that twin must give the int4 engine's greedy tokens. Quantizing the merged
qkv / gate_up weight row by row is the same as quantizing its pieces (groups run along K)."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpage.config import check_quantization, int4_group_for, online_int4_group_size
from flashpage.layers.int4 import int4_linears
from flashpage.models.int4_formats import quantize_int4
from tests.conftest import hf_greedy, random_prompts

GPU = torch.cuda.is_available()


def _twin(src: Path, dst: Path, group: int | None = 128, dtype: torch.dtype = torch.float32) -> Path:
    """``src`` with every linear's weight dequantized from its int4 form, rounded from the
    weight as an engine of ``dtype`` holds it (it quantizes after loading into its dtype)."""
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            w = w.to(dtype)
            g = int4_group_for(w.shape[1], group)
            q, s, z = quantize_int4(w, g)
            gk = g or w.shape[1]
            tensors[name] = ((q.float() - z.float().repeat_interleave(gk, 1))
                             * s.float().repeat_interleave(gk, 1))
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


# ----------------------------------------------------------------------------- settings
def test_group_sizes_follow_k():
    assert int4_group_for(4096, 128) == 128
    assert int4_group_for(576, 128) == 64  # SmolLM2's hidden size
    assert int4_group_for(24, 128) == 8
    assert int4_group_for(4096, None) is None
    assert int4_group_for(20, 128) is None  # no power of two >= 8 divides it: one group a row


def test_rtn_reads_vllms_environment(monkeypatch):
    monkeypatch.delenv("RTN_NUM_BITS", raising=False)
    monkeypatch.delenv("RTN_GROUP_SIZE", raising=False)
    assert online_int4_group_size("int4") == 128
    with pytest.raises(ValueError, match=r"RTN_NUM_BITS='8' \(vLLM's default when unset\)"):
        check_quantization("rtn")  # vLLM's rtn is 8-bit unless told: refused, not narrowed
    monkeypatch.setenv("RTN_NUM_BITS", "4")
    check_quantization("rtn")
    monkeypatch.setenv("RTN_GROUP_SIZE", "-1")
    assert online_int4_group_size("rtn") is None
    for bad in ("12", "0", "x"):
        monkeypatch.setenv("RTN_GROUP_SIZE", bad)
        with pytest.raises(ValueError, match="RTN_GROUP_SIZE must be a positive multiple of 8"):
            check_quantization("int4")
    with pytest.raises(ValueError, match="quantization must be None or one of 'fp8', 'int4', 'rtn'"):
        check_quantization("int8")


# ----------------------------------------------------------------------------- engine
@pytest.mark.parametrize("model", ["llama31_gqa", "qwen2_bias"])
def test_int4_engine_tokens_equal_transformers_on_the_rounded_twin(tiny_checkpoint, tmp_path, model):
    """fp32 on the CPU: LLM(quantization="int4") over the 16-bit checkpoint gives
    transformers' greedy tokens over the twin holding what int4 keeps; every attention and
    MLP linear is int4, the LM head not."""
    from flashpage import LLM, SamplingParams

    src = tiny_checkpoint(model)
    prompts = random_prompts(3, 3, 20, seed=5)
    llm = LLM(str(src), device="cpu", dtype="float32", quantization="int4")
    names = int4_linears(llm.engine.model)
    assert len(names) == 2 * 4 and not any("lm_head" in n for n in names)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    del llm
    gc.collect()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(_twin(src, tmp_path / "twin"), prompts, 10)


def test_int4_weights_are_a_quarter_in_inspect(tiny_checkpoint, capsys):
    from flashpage.inspect import main

    path = str(tiny_checkpoint("llama31_gqa"))
    assert main([path, "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main([path, "--json", "--quantization", "int4"]) == 0
    int4 = json.loads(capsys.readouterr().out)
    cfg = json.loads((Path(path) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    # per layer: qkv + o over K = h (one group of 64), gate_up over K = h, down over K = inter
    shapes = [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)]
    saved = sum(n * k * 2 - n * k // 2 - 3 * n * (k // int4_group_for(k, 128))  # type: ignore[operator]
                for n, k in shapes) * cfg["num_hidden_layers"]
    assert bf16["weights_bytes"] - int4["weights_bytes"] == saved


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_int4_engine_bf16_on_the_gpu_with_graphs(tiny_checkpoint, tmp_path):
    """bf16 on CUDA with the engine's defaults (graphs, the int4 GEMV at decode): where the
    twin's bf16 engine is sure of its greedy token (top-2 margin > 1), the int4 engine ranks
    it first too, fed the twin's output as a prompt, and the other way round."""
    from flashpage import LLM, SamplingParams

    src = tiny_checkpoint("head128_gqa")
    # the engine rounds the bf16 weights (H200 run 173: a twin rounded from the fp32 file's
    # differs in a few q steps, and the check failed on it)
    twin = _twin(src, tmp_path / "twin", dtype=torch.bfloat16)
    prompts = random_prompts(8, 3, 200, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    forced = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def run(folder, quantization, check=None):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(str(folder), dtype="bfloat16", num_gpu_blocks=512, quantization=quantization)
        assert llm.engine.runner.graphs is not None
        assert (len(int4_linears(llm.engine.model)) > 0) == (quantization == "int4")
        if check is not None:
            sure, full = check
            outs = llm.generate(full, forced, use_tqdm=False)
            ranks = torch.tensor([e.rank for p, o in zip(prompts, outs, strict=True)
                                  for e in o.prompt_logprobs[len(p):]])
            assert torch.all(ranks[sure] == 1)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        margins = torch.tensor([lp.top[0][1] - lp.top[1][1] for o in outs for lp in o.outputs[0].logprobs])
        return margins > 1.0, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]

    base = run(twin, None)
    quant = run(src, "int4", base)
    run(twin, None, quant)
