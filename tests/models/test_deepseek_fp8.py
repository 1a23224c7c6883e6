"""--kv-cache-dtype fp8 for MLA models (DeepSeek-V2/V3): the latent cache
[num_blocks, block_size, kv_lora_rank + rope] holds float8_e4m3fn (scale 1); entries are
rounded to e4m3 as they are written and up-cast to the model's dtype as they are read, on
both the absorbed decode path and the expanded prefill path.

The check that could fail: an fp8-cache engine must give exactly the tokens of a
full-precision engine whose latent entries are rounded through e4m3 before they are
written (so both attend over the same values), through chunked prefill, prefix hits and
decodes; without the rounding some token differs. CPU, torch_native, fp32. Then the
triton backend (the Triton interpreter, fp32) over an fp8 latent cache gives the
torch_native fp8 engine's tokens. The Triton kernels one by one:
tests/kernels/test_mla_fp8.py (and, in the engine on a GPU with CUDA graphs, its
test_engine_triton_fp8_latents_equal_torch_native_gpu).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from flashpage import SamplingParams
from flashpage.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.layers import mla_attention
from tests.conftest import random_prompts, run_staggered, staggered_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NAMES = ["deepseek_v2", "deepseek_v3"]
FP8 = torch.float8_e4m3fn


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", device="cpu", block_size=8,
               max_num_batched_tokens=32, attention_backend="torch_native")
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


@pytest.mark.parametrize("name", NAMES)
def test_fp8_latents_equal_full_precision_over_rounded_latents(tiny_mla_checkpoint, name,
                                                                monkeypatch):
    path = tiny_mla_checkpoint(name)
    write = mla_attention.write_mla_cache_torch
    seen: dict[str, list[torch.Tensor]] = {"caches": [], "written": []}

    def spying_write(latent, kv_cache, slots):  # the fp8 run's writes, as they happen
        seen["caches"].append(kv_cache)
        seen["written"].append(latent)
        write(latent, kv_cache, slots)

    monkeypatch.setattr(mla_attention, "write_mla_cache_torch", spying_write)
    fp8 = _engine(path, kv_cache_dtype="fp8")
    mc = fp8.model_config
    caches = fp8.runner.kv_caches
    assert len(caches) == mc.num_hidden_layers
    for c in caches:
        assert isinstance(c, torch.Tensor) and c.dtype == FP8
        assert c.shape == (fp8.num_blocks, 8, mc.kv_lora_rank + mc.qk_rope_head_dim)
    run = run_staggered(fp8, staggered_prompts(), GREEDY)
    got = run["outputs"]
    assert run["chunks"] and run["mixed_steps"]  # chunked prefill, decodes beside chunks
    assert fp8.kv_manager.stats().prefix_hits > 0
    assert fp8.kv_manager.stats().blocks_used == 0
    assert seen["caches"] and all(c.dtype == FP8 for c in seen["caches"])
    # the latents stayed inside e4m3's range, so the reference's plain cast equals the
    # saturating fp8 write (and the rounding below is the write's, not a clamp's)
    assert max(float(x.abs().max()) for x in seen["written"]) < 448

    def rounded_write(latent, kv_cache, slots):
        write(latent.to(FP8).to(latent.dtype), kv_cache, slots)

    monkeypatch.setattr(mla_attention, "write_mla_cache_torch", rounded_write)
    full = _engine(path)
    assert full.runner.kv_caches[0].dtype == torch.float32
    want = run_staggered(full, staggered_prompts(), GREEDY)["outputs"]
    assert got == want
    # and the rounding matters: without it some token differs (else this test shows nothing)
    monkeypatch.setattr(mla_attention, "write_mla_cache_torch", write)
    plain = run_staggered(_engine(path), staggered_prompts(), GREEDY)["outputs"]
    assert plain != want


@pytest.mark.parametrize("name", NAMES)
def test_fp8_latent_cache_holds_more_tokens(tiny_mla_checkpoint, name):
    """Same memory: a quarter of fp32's bytes per latent entry, four times the blocks."""
    path = tiny_mla_checkpoint(name)
    mem = dict(cpu_kv_cache_bytes=1 << 20, max_num_seqs=4096)
    fp32, fp8 = _engine(path, **mem), _engine(path, kv_cache_dtype="fp8", **mem)
    assert fp8.num_blocks == 4 * fp32.num_blocks
    total8 = sum(c.nbytes for c in fp8.runner.kv_caches)
    total32 = sum(c.nbytes for c in fp32.runner.kv_caches)
    assert total8 == total32 <= 1 << 20



@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("name", NAMES)
def test_triton_backend_fp8_latents_equal_torch_native_interpreted(tiny_mla_checkpoint, name,
                                                                    monkeypatch):
    """The latent write kernel, the MLA decode kernel (absorbed decodes) and the prefill
    kernel over latents expanded from the fp8 cache: torch_native's tokens, fp32."""
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    import flashpage.kernels.mla_decode as mla_decode_mod

    # Triton 3.6's interpreter casts to fp8 wrongly on ~10% of values: torch's casts
    # instead, as in tests/kernels/test_fp8_kv.py (whose GPU tests check the hardware's)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from test_fp8_kv import _torch_fp8_convert

    monkeypatch.setattr(interpreter, "_convert_float", _torch_fp8_convert(interpreter._convert_float))
    decodes: list[torch.dtype] = []
    original = mla_decode_mod._plan  # the triton backend plans the decode once a step

    def spy(q, kv_cache, *a, **kw):
        decodes.append(kv_cache.dtype)
        return original(q, kv_cache, *a, **kw)

    monkeypatch.setattr(mla_decode_mod, "_plan", spy)
    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(5, 3, 30, seed=5)
    prompts[0] += list(range(3, 23))  # 20 tokens or more, computed by the time the last comes
    prompts.append(prompts[0][:17] + [9, 8, 7])  # a prefix hit on two 8-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def run(backend):
        eng = _engine(path, kv_cache_dtype="fp8", attention_backend=backend,
                      max_num_batched_tokens=24)
        assert eng.backend_name == backend
        assert all(c.dtype == FP8 for c in eng.runner.kv_caches)
        out = run_staggered(eng, prompts, params)
        assert eng.kv_manager.stats().prefix_hits > 0
        return out["outputs"]

    got = run("triton")
    assert decodes and set(decodes) == {FP8}, "the MLA decode kernel never read the fp8 cache"
    assert got == run("torch_native")
