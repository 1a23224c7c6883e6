"""float8_e4m3fn MLA latent caches (DeepSeek-V2/V3, ``--kv-cache-dtype fp8``) in the Triton
latent write and the MLA decode kernel.

Contract (kernels/kv_dtype.py): a kernel infers an fp8 cache from its dtype. The write
rounds each latent value to e4m3 (bit for bit torch's ``.to(torch.float8_e4m3fn)`` within
+-448; the GPU saturates past it); the decode kernel widens each latent tile to q's dtype
right after its load, so it must match ``mla_decode_ref`` on that same cache within the
16-bit-cache tolerances of test_mla_decode.py, and differ from a 16-bit cache of the same
latents by what e4m3 rounding does to its inputs (test_fp8_kv.check_fp8_attention).

CPU (Triton interpreter, its fp8 casts patched to torch's as in test_fp8_kv.py): fp32 and
fp16, small ranks plus DeepSeek's 512 + 64; the fp8 variants also compiled for sm_90.
GPU (marked gpu): bf16 queries, DeepSeek's head counts, every candidate config, a CUDA
graph, and the engine's triton backend against torch_native over an fp8 latent cache.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from flashpage.kernels.cache_write import _write_mla, write_mla_cache, write_mla_cache_ref
from flashpage.kernels.mla_cache_write import CANDIDATE_TILES, unit_elems, write_mla_cache_vec
from flashpage.kernels.mla_decode import (
    CANDIDATE_CONFIGS,
    MLADecodeConfig,
    config_name,
    mla_decode,
    mla_decode_ref,
)

sys.path.insert(0, os.path.dirname(__file__))
from sm90 import compile_sm90, run_compiled  # noqa: E402
from test_fp8_kv import (  # noqa: E402
    DEVICE,
    DTYPES,
    FP8,
    assert_fp8_equal,
    check_fp8_attention,
    cpu_only,
    exact_fp8_casts_in_the_interpreter,  # noqa: F401  (autouse: this module's fp8 casts too)
    gpu_only,
    special_values,
)

# test_mla_decode.py's bounds on ||out - ref|| / ||ref|| (the fp8 values reach the dots
# exactly, so the kernel's own rounding is all that is left against the same cache)
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def fp8_nan(shape) -> torch.Tensor:
    """An fp8 tensor of NaN (code 0x7f): a slot read or written by mistake shows."""
    return torch.full(shape, float("nan"), device=DEVICE).to(FP8)


# --------------------------------------------------------------------------- latent write


def latent_inputs(n: int, width: int, pad: int, dtype: torch.dtype, g: torch.Generator):
    """latent [n, width] as a view of [n, width + pad] rows, spread over e4m3's range
    (per-token scales 2^-12 .. 2^6, clamped to +-448); row 0 holds special_values()."""
    x = torch.randn(n, width + pad, generator=g, device=DEVICE)
    scale = torch.exp2(torch.randint(-12, 7, (n, 1), generator=g, device=DEVICE).float())
    x = (x * scale).clamp(-448, 448)
    sv = special_values()
    x[0] = sv.repeat(-(-(width + pad) // sv.numel()))[: width + pad]
    return x.to(dtype)[:, :width]


def slots_for(n: int, num_blocks: int, page: int, g: torch.Generator, num_skipped: int):
    """Distinct slots; num_skipped tokens (never token 0) set to -1."""
    slots = torch.randperm(num_blocks * page, generator=g, device=DEVICE)[:n]
    slots[torch.randperm(n - 1, generator=g, device=DEVICE)[:num_skipped] + 1] = -1
    return slots


def check_write(write, latent, cache, slots) -> None:
    """write(latent, cache, slots) stores torch's e4m3 cast of each kept row, bit for bit,
    and leaves every other slot (NaN) alone."""
    ref = cache.clone()
    write(latent, cache, slots)
    write_mla_cache_ref(latent, ref, slots)
    assert_fp8_equal(cache, ref)
    assert not cache.flatten(0, 1)[slots[slots >= 0]].float().isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "width,pad,vec16",  # vec16: elements per unit for a 2-byte latent
    [(576, 0, 8), (576, 4, 4), (40, 0, 8), (72, 2, 2), (33, 0, 1)],
)
def test_write_mla_cache_fp8(width, pad, vec16, dtype):
    """The 16-byte-unit kernel: 16 bytes of the latent per unit (8 bytes of fp8 cache),
    fewer where the width or a row stride is not a multiple of it."""
    g = gen(width + pad)
    n, num_blocks, page = 37, 4, 16
    latent = latent_inputs(n, width, pad, dtype, g)
    cache = fp8_nan((num_blocks, page, width))
    assert unit_elems(latent, cache) == min(vec16, 16 // latent.element_size())
    slots = slots_for(n, num_blocks, page, g, num_skipped=4)
    # 64 units per program: programs end mid-row, so a token's units span two programs
    check_write(lambda *a: write_mla_cache_vec(*a, tile=(64, 4)), latent, cache, slots)


def test_write_mla_cache_fp8_default_path():
    """cache_write.write_mla_cache (what the triton backend calls), default tile."""
    g = gen(1)
    latent = latent_inputs(29, 576, 0, DTYPES[-1], g)
    check_write(write_mla_cache, latent, fp8_nan((3, 16, 576)), slots_for(29, 3, 16, g, 5))


@pytest.mark.parametrize("offset,vec", [(0, 8), (8, 8), (4, 4), (2, 2), (1, 1)])
def test_write_mla_cache_fp8_cache_base_alignment(offset, vec):
    """An fp8 cache starting ``offset`` bytes past a 16-byte boundary: its base address is
    counted in its own 1-byte elements (not the latent's 2), so a unit is as wide as the
    cache's alignment allows and no store crosses into a misaligned vector."""
    g = gen(offset)
    dtype = torch.float16
    n, num_blocks, page, width = 21, 3, 16, 64
    latent = latent_inputs(n, width, 0, dtype, g)
    buf = fp8_nan((num_blocks * page * width + 16,))
    cache = buf[offset:offset + num_blocks * page * width].view(num_blocks, page, width)
    assert cache.data_ptr() % 16 == offset
    assert unit_elems(latent, cache) == vec
    slots = slots_for(n, num_blocks, page, g, num_skipped=3)
    before = buf.clone()
    check_write(lambda *a: write_mla_cache_vec(*a, tile=(32, 4)), latent, cache, slots)
    # the bytes around the view are untouched
    assert_fp8_equal(buf[:offset], before[:offset])
    assert_fp8_equal(buf[offset + cache.numel():], before[offset + cache.numel():])


@pytest.mark.parametrize("width", [576, 33])
def test_write_mla_tile_kernel_fp8(width):
    """The earlier [tokens, chunk] tile kernel (cache_write._write_mla), kept importable."""
    g = gen(width)
    latent = latent_inputs(29, width, 0, DTYPES[-1], g)
    check_write(lambda *a: _write_mla(*a, 2048, 4), latent, fp8_nan((3, 16, width)),
                slots_for(29, 3, 16, g, 4))


# --------------------------------------------------------------------------- MLA decode


def latent_pair(seq_lens: list[int], rank: int, rope: int, page: int, dtype: torch.dtype,
                g: torch.Generator):
    """Each sequence's latents (randn, in dtype) at shuffled blocks, written by
    write_mla_cache into a 16-bit cache and an fp8 cache through the same slots; every
    other slot NaN. -> (kv16, kv8, block_tables int32 [B, max_blocks + 1], seq_lens int32)."""
    nblk = [-(-n // page) for n in seq_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE)
    tables = torch.full((len(seq_lens), max(nblk) + 1), num_blocks - 1, dtype=torch.int32,
                        device=DEVICE)  # the padded column: a never-written block
    slots, used = [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[used:used + nblk[b]]
        used += nblk[b]
        tables[b, :nblk[b]] = ids.int()
        pos = torch.arange(n, device=DEVICE)
        slots.append(ids[pos // page] * page + pos % page)
    slots_t = torch.cat(slots)
    latent = torch.randn(slots_t.numel(), rank + rope, generator=g, device=DEVICE).to(dtype)
    kv16 = torch.full((num_blocks, page, rank + rope), float("nan"), dtype=dtype, device=DEVICE)
    kv8 = fp8_nan(kv16.shape)
    write_mla_cache(latent, kv16, slots_t)
    write_mla_cache(latent, kv8, slots_t)
    return kv16, kv8, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def run_decode_case(seq_lens, heads, rank, rope, page, dtype, *, num_splits=None, config=None,
                    seed=0):
    g = gen(seed + sum(seq_lens))
    kv16, kv8, tables, lens = latent_pair(seq_lens, rank, rope, page, dtype, g)
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=g, device=DEVICE).to(dtype)
    kw = dict(kv_lora_rank=rank, sm_scale=1.0 / math.sqrt(rank + rope))
    out8 = torch.full((len(seq_lens), heads, rank), float("nan"), dtype=dtype, device=DEVICE)
    mla_decode(q, kv8, tables, lens, out=out8, num_splits=num_splits, config=config, **kw)
    out16 = mla_decode(q, kv16, tables, lens, num_splits=num_splits, config=config, **kw)
    ref8 = mla_decode_ref(q, kv8, tables, lens, **kw)
    ref16 = mla_decode_ref(q, kv16, tables, lens, **kw)
    assert out8.dtype == dtype
    check_fp8_attention(out8, ref8, out16, ref16, REL_TOL[dtype])


SMALL = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
FUSED = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1,
                        fuse_merge_max_splits=64)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens,heads,page,num_splits,config",
    [
        ([1, 37, 64], 4, 16, 1, SMALL),  # no splits; a single key; heads padded to BLOCK_H
        ([50, 1, 130], 16, 8, 3, SMALL),  # 3 splits (merge kernel), one empty
        ([100], 20, 32, 2, SMALL),  # two head blocks, the second partial
        ([70, 9], 16, 16, 4, FUSED),  # the last split merges in the kernel
        ([40, 3], 16, 16, None, SMALL),  # splits picked by the heuristic
    ],
    ids=["nosplit", "split3", "heads20", "fused", "auto"],
)
def test_mla_decode_fp8(seq_lens, heads, page, num_splits, config, dtype):
    run_decode_case(seq_lens, heads, 64, 16, page, dtype, num_splits=num_splits, config=config)


@cpu_only
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mla_decode_fp8_deepseek_width(num_splits):
    """DeepSeek's 512 + 64 entry, fp16 (the interpreter's half-precision dots)."""
    run_decode_case([45, 20], 16, 512, 64, 16, torch.float16, num_splits=num_splits, config=SMALL)


def test_mla_fp8_rejects_other_dtypes():
    """e5m2 (or another fp8) latent cache, and a 16-bit cache that is not q's dtype, are
    refused by name by the write and the decode kernel."""
    q = torch.zeros(2, 16, 80, device=DEVICE)
    latent = torch.zeros(2, 80, device=DEVICE)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    cache8 = torch.zeros(2, 16, 80, device=DEVICE).to(FP8)
    calls = {
        "mla_decode": lambda c: mla_decode(q, c, tables, lens, kv_lora_rank=64, sm_scale=0.1,
                                           config=SMALL),
        "write_mla_cache": lambda c: write_mla_cache(latent, c, slots),
        "_write_mla": lambda c: _write_mla(latent, c, slots, 2048, 4),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="float8_e5m2"):
            call(cache8.to(torch.float8_e5m2))
        with pytest.raises(ValueError, match="dtype mismatch"):
            call(cache8.to(torch.float16))
        call(cache8.clone())  # accepted


# --------------------------------------------------------------------------- sm_90 compile (CPU)


def _compile_mla_fp8() -> dict[str, dict]:
    """The fp8 variants of the MLA write and decode kernels compiled for sm_90 with bf16
    activations (the decode kernel at the Hopper defaults for 16 and 128 heads, also over
    a bf16 cache for comparison): name -> {"ptx", "shared" bytes} (Triton ships ptxas; the
    interpreter off, in a subprocess)."""
    from flashpage.kernels import cache_write as cw
    from flashpage.kernels import mla_cache_write as mcw
    from flashpage.kernels import mla_decode as md

    ptr = {"slot_mapping_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
           "counter_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"}
    kernels = {
        "write_mla_vec": (mcw._write_mla_vec_kernel, dict(PAGE=16, UNITS=72, VEC=8, BLOCK=1024),
                          "*fp8e4nv", 4, 3),
        "write_mla_tile": (cw._write_mla_kernel, dict(PAGE=16, WIDTH=576, BLOCK_T=64, CHUNK=64),
                           "*fp8e4nv", 8, 3),
    }
    for heads in (16, 128):
        cfg = md.default_config(heads)
        for fused in (False, True):
            consts = dict(RANK=512, ROPE=64, BLOCK_R=512, BLOCK_P=64, BLOCK_H=cfg.block_h,
                          BLOCK_N=cfg.block_n, PAGE=16, IEEE=False, PDL=False, SPLIT=fused,
                          FUSED=fused, QK_CHUNKS=cfg.qk_chunks)
            for kv in ("fp8", "bf16"):
                kernels[f"mla_decode_h{heads}{'_fused' if fused else ''}_{kv}"] = (
                    md._mla_decode_kernel, {**consts, "F16_DOTS": kv == "fp8", "PREFETCH": False},
                    "*fp8e4nv" if kv == "fp8" else "*bf16",
                    cfg.num_warps, cfg.num_stages)
    out = {}
    for name, (fn, consts, cache_ty, warps, stages) in kernels.items():
        types = {**ptr, "kv_cache_ptr": cache_ty, "kv_ptr": cache_ty, "sm_scale_log2": "fp32"}
        k = compile_sm90(fn, consts, types, num_warps=warps, num_stages=stages)
        out[name] = {"ptx": k.asm["ptx"], "shared": k.metadata.shared}
    return out


@cpu_only
def test_mla_fp8_kernels_compile_for_sm90():
    """The writes convert with cvt.rn.satfinite (round to nearest even, saturating at 448);
    the decode kernel widens e4m3 in registers (to fp16, for fp16 dots), never converts to
    fp8, and needs no more
    shared memory over an fp8 cache than over a bf16 one (the widened tile must not add a
    buffer that the Hopper defaults, tuned for bf16, have no room for)."""
    got = run_compiled("test_mla_fp8", "_compile_mla_fp8")
    assert len(got) == 10
    for name in ("write_mla_vec", "write_mla_tile"):
        assert "cvt.rn.satfinite.e4m3x2" in got[name]["ptx"], name
    for name, k in got.items():
        if name.startswith("mla_decode") and name.endswith("_fp8"):
            assert "e4m3x2" in k["ptx"], f"{name}: no e4m3 conversion"
            assert "satfinite" not in k["ptx"], f"{name}: converts to fp8"
            # widened to fp16 in one step, fp16 dots (through fp16 to bf16: 3 conversions)
            assert "cvt.bf16.f16" not in k["ptx"], f"{name}: widens fp8 to bf16"
            assert ".bf16.bf16.f32" not in k["ptx"], f"{name}: bf16 dots"
            bf16 = got[name.replace("_fp8", "_bf16")]["shared"]
            assert k["shared"] <= bf16, f"{name}: {k['shared']} bytes of shared memory, bf16 {bf16}"


# --------------------------------------------------------------------------- GPU, bf16


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("tile", CANDIDATE_TILES, ids=lambda t: f"{t[0]}u{t[1]}w")
def test_write_mla_cache_fp8_gpu(tile):
    g = gen(tile[0])
    for n, pad in ((1, 0), (3000, 0), (777, 64)):  # 777 rows of a wider projection output
        latent = latent_inputs(n, 576, pad, torch.bfloat16, g)
        num_blocks = 2 * n // 16 + 2
        check_write(lambda *a, t=tile: write_mla_cache_vec(*a, tile=t), latent,
                    fp8_nan((num_blocks, 16, 576)), slots_for(n, num_blocks, 16, g, min(n - 1, 40)))


@pytest.mark.gpu
@gpu_only
def test_write_mla_cache_fp8_gpu_saturates():
    """Past +-448 (infinities included) the GPU's conversion saturates; NaN stays NaN; 400,
    the tie between 384 and 416, rounds to the even 384."""
    vals = torch.tensor([460.0, -500.0, 1e4, -float("inf"), float("nan"), 400.0], device=DEVICE)
    latent = vals.to(torch.bfloat16)[:, None].expand(6, 576).contiguous()
    cache = fp8_nan((1, 8, 576))
    write_mla_cache(latent, cache, torch.arange(6, device=DEVICE))
    got = cache[0, :6, 0].float().tolist()
    assert got[:4] == [448.0, -448.0, 448.0, -448.0] and math.isnan(got[4]) and got[5] == 384.0
    assert torch.equal(cache[0, :6].view(torch.uint8), cache[0, :6, :1].view(torch.uint8).expand(6, 576))


# (seq_lens, heads, page, num_splits): DeepSeek-V2-Lite's 16 heads and V3's 128, 512 + 64
GPU_DECODE_CASES = [
    ([1, 900, 4000, 77], 16, 16, None),
    ([3000, 17], 16, 16, 1),
    ([2048], 128, 64, None),  # one sequence: split across the GPU
    ([500, 1200, 33, 7, 2500, 64, 1, 300], 128, 16, None),
    ([700, 64], 16, 32, 4),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", GPU_DECODE_CASES, ids=lambda c: f"h{c[1]}-p{c[2]}-s{c[3]}-b{len(c[0])}")
def test_mla_decode_fp8_gpu(case):
    lens, heads, page, splits = case
    run_decode_case(lens, heads, 512, 64, page, torch.bfloat16, num_splits=splits)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("cfg", CANDIDATE_CONFIGS + [
    MLADecodeConfig(16, 32, 4, 3, 2, fuse_merge_max_splits=8)], ids=config_name)
def test_mla_decode_fp8_gpu_configs(cfg):
    """Every tile the sweep may pick (so whichever becomes the fp8 default has been run),
    with splits through the merge kernel and, for the last one, in-kernel."""
    run_decode_case([1500, 40, 333], cfg.block_h, 512, 64, 16, torch.bfloat16, num_splits=4,
                    config=cfg)


@pytest.mark.gpu
@gpu_only
def test_mla_decode_fp8_cuda_graph():
    """Captured over an fp8 latent cache (splits picked from the table width, merge
    kernel), replayed with new queries and lengths."""
    g = gen(3)
    _, kv8, tables, lens = latent_pair([900, 20, 2000], 512, 64, 16, torch.bfloat16, g)
    q = torch.randn(3, 16, 576, generator=g, device=DEVICE).bfloat16()
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    kw = dict(kv_lora_rank=512, sm_scale=576**-0.5)
    mla_decode(q, kv8, tables, lens, out=out, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, kv8, tables, lens, out=out, **kw)
    for new_lens in ([850, 20, 1500], [1, 19, 64], [899, 1, 1999]):
        q.copy_(torch.randn(q.shape, generator=g, device=DEVICE))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = mla_decode_ref(q, kv8, tables, lens, **kw)
        assert not out.isnan().any()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < REL_TOL[torch.bfloat16], err


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_engine_triton_fp8_latents_equal_torch_native_gpu(tiny_mla_checkpoint, name):
    """fp32 model, fp8 latent cache on the GPU: our kernels (rounding latent writes,
    up-casting MLA decode, decode steps replayed from CUDA graphs) give torch_native's
    tokens exactly, as they do over an fp32 cache."""
    from flashpage import LLM, SamplingParams
    from flashpage.engine.cuda_graph import DecodeGraphs
    from tests.conftest import random_prompts

    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(12, 1, 120, seed=9)
    prompts.append(prompts[3] + [5, 6, 7])  # a prefix hit
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]  # decode batches shrink through the graph buckets
    replays: list[int] = []
    original = DecodeGraphs.run

    def counting(self, input_ids, *a, **kw):
        replays.append(input_ids.shape[0])
        return original(self, input_ids, *a, **kw)

    def run(backend):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend,
                  block_size=16, max_num_batched_tokens=32, max_num_seqs=16, kv_cache_dtype="fp8")
        assert llm.engine.backend_name == backend
        assert all(c.dtype == FP8 for c in llm.engine.runner.kv_caches)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv_manager.stats().prefix_hits > 0
        return [o.outputs[0].token_ids for o in outs], llm

    DecodeGraphs.run = counting  # type: ignore[method-assign]
    try:
        got, llm = run("triton")
    finally:
        DecodeGraphs.run = original  # type: ignore[method-assign]
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    assert 1 in replays and max(replays) > 2, replays
    want, _ = run("torch_native")
    assert got == want
