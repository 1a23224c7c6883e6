"""--kv-cache-dtype fp8: K/V cached as float8_e4m3fn (scale 1), read back up-cast.

The check that could fail: an fp8-cache engine must give exactly the tokens of a
full-precision engine whose K/V are rounded through e4m3 before they are written (so
both attend over the same values), through chunked prefill, prefix hits and decodes.
"""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.attention import torch_native
from flashpage.attention.registry import BackendUnavailable
from flashpage.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from tests.conftest import run_staggered, staggered_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", device="cpu", block_size=8,
               max_num_batched_tokens=32, attention_backend="torch_native")
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def test_fp8_cache_equals_full_precision_over_rounded_kv(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("head64_gqa")
    fp8 = _engine(path, kv_cache_dtype="fp8")
    caches = fp8.runner.kv_caches
    assert all(kc.dtype == vc.dtype == torch.float8_e4m3fn for kc, vc in caches)
    run = run_staggered(fp8, staggered_prompts(), GREEDY)
    got = run["outputs"]
    assert run["chunks"] and run["mixed_steps"]  # chunked prefill, decodes beside chunks
    assert fp8.kv_manager.stats().prefix_hits > 0
    assert fp8.kv_manager.stats().blocks_used == 0

    write = torch_native.write_kv_cache_torch

    def rounded_write(k, v, key_cache, value_cache, slots):
        e4m3 = torch.float8_e4m3fn
        write(k.to(e4m3).to(k.dtype), v.to(e4m3).to(v.dtype), key_cache, value_cache, slots)

    monkeypatch.setattr(torch_native, "write_kv_cache_torch", rounded_write)
    full = _engine(path)
    assert full.runner.kv_caches[0][0].dtype == torch.float32
    want = run_staggered(full, staggered_prompts(), GREEDY)["outputs"]
    assert got == want
    # and the rounding matters: without it some token differs (else this test shows nothing)
    monkeypatch.setattr(torch_native, "write_kv_cache_torch", write)
    plain = run_staggered(_engine(path), staggered_prompts(), GREEDY)["outputs"]
    assert plain != want


def test_fp8_cache_holds_more_tokens(tiny_checkpoint):
    """Same memory: a quarter of fp32's bytes per token, four times the blocks."""
    path = tiny_checkpoint("head64_gqa")
    mem = dict(cpu_kv_cache_bytes=1 << 20, max_num_seqs=4096)
    fp32, fp8 = _engine(path, **mem), _engine(path, kv_cache_dtype="fp8", **mem)
    assert fp8.num_blocks == 4 * fp32.num_blocks


def test_gather_paged_reads_an_fp8_cache_as_its_bytes():
    """gather_paged over a float8_e4m3fn cache (gathered as uint8, viewed back): the same
    entries, in the cache's dtype, as indexing the values directly; every e4m3 value,
    NaN patterns included, comes back bit for bit."""
    cache = torch.arange(256, dtype=torch.uint8).view(8, 4, 8).view(torch.float8_e4m3fn)
    table = torch.tensor([5, 2, 7], dtype=torch.int32)
    got = torch_native.gather_paged(cache, table, 10)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (10, 8)
    want = cache.view(torch.uint8)[[5, 2, 7]].flatten(0, 1)[:10]
    assert torch.equal(got.view(torch.uint8), want)


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int8")


def test_flex_backend_says_why_it_cannot_read_fp8(tiny_checkpoint):
    with pytest.raises(BackendUnavailable, match="float8_e4m3fn KV cache is not supported by the flex"):
        LLM(str(tiny_checkpoint("head64_gqa")), dtype="float32", device="cpu",
            attention_backend="flex", kv_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_fp8_cache_equals_torch_native_gpu(tiny_checkpoint):
    """fp32 model, fp8 cache on the GPU: our kernels (rounding writes, up-casting reads,
    CUDA graphs) give torch_native's tokens exactly, as they do over an fp32 cache."""
    from tests.conftest import random_prompts

    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(12, 1, 120, seed=9)
    prompts.append(prompts[3] + [5, 6, 7])  # a prefix hit

    def run(backend):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend,
                  block_size=16, max_num_batched_tokens=32, kv_cache_dtype="fp8")
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    assert run("triton") == run("torch_native")
