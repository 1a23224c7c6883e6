"""MLA decode kernel against its pure-PyTorch reference.

CPU (Triton interpreter): fp32 and fp16, small ranks plus one case with DeepSeek's real
512 + 64 entry. CPU (sm_90 SASS, Triton's ptxas and nvdisasm): the chunked Q K^T runs as
independent mma chains. GPU: bf16 over batch, context, heads (16, 128) and block size.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashpage.kernels.mla_decode import (
    CANDIDATE_CONFIGS,
    MLADecodeConfig,
    config_name,
    default_config,
    mla_decode,
    mla_decode_ref,
    pick_num_splits,
)

sys.path.insert(0, os.path.dirname(__file__))
from sm90 import run_compiled, sass_instructions, sass_loops  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ‖out - ref‖ / ‖ref‖ bounds: exact fp32 dots; fp16/bf16 operands (P is rounded too).
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_case(seq_lens: list[int], heads: int, rank: int, rope: int, page: int,
              dtype: torch.dtype, device: str, seed: int = 0):
    """Random latents in a shuffled block pool; spare blocks hold NaN so a stray read shows."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    D = rank + rope
    blocks_per = [math.ceil(n / page) for n in seq_lens]
    max_blocks = max(blocks_per) + 1  # one padding column, never read
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g)
    kv = torch.full((num_blocks, page, D), float("nan"), dtype=torch.float32)
    tables = torch.zeros(B, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        ids = perm[used:used + blocks_per[b]]
        used += blocks_per[b]
        tables[b, : len(ids)] = ids.int()
        for i, blk in enumerate(ids.tolist()):
            valid = min(page, n - i * page)
            kv[blk, :valid] = torch.randn(valid, D, generator=g)
    q = torch.randn(B, heads, D, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(dtype).to(device), kv.to(dtype).to(device), tables.to(device), lens.to(device))


def check(seq_lens, heads, rank, rope, page, dtype, device, num_splits=None, config=None,
          seed=0):
    q, kv, tables, lens = make_case(seq_lens, heads, rank, rope, page, dtype, device, seed)
    scale = 1.0 / math.sqrt(rank + rope)
    ref = mla_decode_ref(q, kv, tables, lens, kv_lora_rank=rank, sm_scale=scale).float()
    # Poison the output: every element must be written.
    out = torch.full((len(seq_lens), heads, rank), float("nan"), dtype=dtype, device=device)
    mla_decode(q, kv, tables, lens, kv_lora_rank=rank, sm_scale=scale, out=out,
               num_splits=num_splits, config=config)
    assert not out.isnan().any()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < REL_TOL[dtype], f"rel err {err:.2e}"


# ------------------------------------------------------------------ CPU / interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "seq_lens,heads,page,num_splits",
    [
        ([1], 16, 16, 1),  # a single key
        ([37, 5, 64], 4, 16, 1),  # heads padded to BLOCK_H; ragged lengths
        ([50, 1, 130], 16, 8, 3),  # splits, one of them empty for the length-1 sequence
        ([100], 20, 32, 2),  # two head blocks, the second partial
        ([300, 2], 16, 16, 100),  # 100 splits: the merge takes the value dims in chunks
    ],
)
def test_mla_decode_small(seq_lens, heads, page, num_splits, dtype):
    cfg = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    check(seq_lens, heads, 64, 16, page, dtype, "cpu", num_splits=num_splits, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_decode_prefetch(dtype):
    """Latent tiles loaded one iteration ahead in registers (MLADecodeConfig.prefetch):
    ragged lengths (1, within a tile, several tiles), splits, one of them empty."""
    cfg = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, prefetch=True)
    for splits in (1, 3):
        check([50, 1, 130], 16, 64, 16, 8, dtype, "cpu", num_splits=splits, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "seq_lens,heads,page,num_splits",
    [
        ([50, 1, 130], 16, 8, 3),  # one split empty for the length-1 sequence
        ([100], 20, 32, 2),  # two head blocks (two counters), the second partial
        ([300, 2], 16, 16, 40),  # many splits, most of them empty for the short one
        ([1, 1], 16, 16, 4),  # every split but the first empty
    ],
)
def test_mla_decode_fused_merge(seq_lens, heads, page, num_splits, dtype):
    """The last split to arrive merges inside the main kernel, and leaves its counters at
    0: a second call (as a CUDA-graph replay would make) is right too."""
    from flashpage.kernels.mla_decode import _COUNTERS

    cfg = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1,
                          fuse_merge_max_splits=64)
    for seed in (0, 1):
        check(seq_lens, heads, 64, 16, page, dtype, "cpu", num_splits=num_splits, config=cfg,
              seed=seed)
        assert not _COUNTERS[torch.device("cpu")].any()


def test_mla_decode_fused_merge_threshold():
    """Splits above fuse_merge_max_splits go through the merge kernel, at or below not."""
    import flashpage.kernels.mla_decode as mod

    merges = mod._MERGE_LAUNCH  # (under the interpreter every launch goes through the JIT)
    cfg = MLADecodeConfig(block_h=16, block_n=16, fuse_merge_max_splits=2)
    before = merges.jit_launches
    check([40, 9], 16, 64, 16, 16, torch.float32, "cpu", num_splits=2, config=cfg)
    assert merges.jit_launches == before
    check([40, 9], 16, 64, 16, 16, torch.float32, "cpu", num_splits=3, config=cfg)
    assert merges.jit_launches == before + 1


@pytest.mark.parametrize("heads", [16, 70])
def test_mla_decode_default_configs(heads):
    """The GPU default tiles (64-entry tiles over 16-token pages for many heads)."""
    check([150, 3, 64], heads, 64, 16, 16, torch.float32, "cpu", num_splits=2,
          config=default_config(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "chunks,prefetch,fuse",
    [(2, False, 0), (4, False, 0), (4, True, 0), (4, False, 64)],
    ids=["c2", "c4", "c4-prefetch", "c4-fused"],
)
def test_mla_decode_qk_chunks(chunks, prefetch, fuse, dtype):
    """Value dims in column chunks (MLADecodeConfig.qk_chunks; 16-wide at rank 64): ragged
    lengths (1, within a tile, several tiles), two head blocks (the second partial),
    splits (one of them empty) through the merge kernel or merged in the kernel."""
    cfg = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, prefetch=prefetch,
                          fuse_merge_max_splits=fuse, qk_chunks=chunks)
    for splits in (1, 3):
        check([50, 1, 130], 20, 64, 16, 8, dtype, "cpu", num_splits=splits, config=cfg)


@pytest.mark.parametrize(
    "rank,rope,chunks",
    [(40, 8, 4), (16, 16, 4), (64, 16, 8)],
    ids=["rank40-padded-chunks", "rank16-one-chunk", "rank64-8-chunks-of-16"],
)
def test_mla_decode_qk_chunks_ranks(rank, rope, chunks):
    """A rank that is no power of two (chunks of 16 over 64 padded dims: the third holds
    dims 32-47 of which 40-47 are padding, the fourth only padding); a rank too small to
    split (one 16-wide chunk whatever the config asks); 8 chunks."""
    cfg = MLADecodeConfig(block_h=16, block_n=16, qk_chunks=chunks)
    check([23, 9], 3, rank, rope, 4, torch.float32, "cpu", num_splits=2, config=cfg)


def test_mla_decode_qk_chunks_must_be_power_of_two():
    with pytest.raises(ValueError, match="qk_chunks"):
        MLADecodeConfig(qk_chunks=3)
    with pytest.raises(ValueError, match="qk_chunks"):
        MLADecodeConfig(qk_chunks=0)


def test_mla_decode_non_pow2_rank():
    cfg = MLADecodeConfig(block_h=16, block_n=16)
    check([23, 9], 3, 48, 8, 4, torch.float32, "cpu", num_splits=2, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunks", [1, 4])
def test_mla_decode_deepseek_dims(dtype, chunks):
    """DeepSeek-V2/V3 latent entry (512 + 64) with a tiny batch and context; the value
    dims whole or in 4 chunks of 128 (the Hopper default at 16 heads)."""
    cfg = MLADecodeConfig(block_h=16, block_n=16, qk_chunks=chunks)
    check([33, 7], 16, 512, 64, 16, dtype, "cpu", num_splits=2, config=cfg)


@pytest.mark.parametrize("num_splits,fuse", [(1, 8), (3, 8), (3, 1)])  # one program / fused / merge kernel
def test_mla_decode_plan_serves_every_layer(num_splits, fuse):
    """An MLADecodePlan made over one layer's q, cache and out launches another layer's
    (other tensors, the same geometry) as mla_decode computes them, splits and their merge
    included; another geometry is refused."""
    from flashpage.kernels.mla_decode import MLADecodePlan

    lens, heads, rank, rope, page = [50, 1, 130], 16, 64, 16, 8
    q1, kv1, tables, lens_t = make_case(lens, heads, rank, rope, page, torch.float32, "cpu", seed=1)
    q2 = torch.randn_like(q1)
    kv2 = kv1.clone()  # the same blocks (the plan's tables), other latents; spare blocks stay NaN
    kv2[~kv1.isnan()] = torch.randn(int((~kv1.isnan()).sum()), generator=torch.Generator().manual_seed(2))
    scale = 0.2
    cfg = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, fuse_merge_max_splits=fuse)
    out1, out2 = torch.empty(3, heads, rank), torch.full((3, heads, rank), float("nan"))
    plan = MLADecodePlan(q1, kv1, tables, lens_t, kv_lora_rank=rank, sm_scale=scale, out=out1,
                         num_splits=num_splits, config=cfg)
    plan.run(q1, kv1, kv1, out1)
    plan.run(q2, kv2, kv2, out2)
    for q, kv, out in ((q1, kv1, out1), (q2, kv2, out2)):
        want = mla_decode(q, kv, tables, lens_t, kv_lora_rank=rank, sm_scale=scale,
                          num_splits=num_splits, config=cfg)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    ref = mla_decode_ref(q2, kv2, tables, lens_t, kv_lora_rank=rank, sm_scale=scale)
    assert (out2 - ref).norm() / ref.norm() < REL_TOL[torch.float32]
    with pytest.raises(ValueError, match="differ in shape"):
        plan.run(q2[:2], kv2, kv2, out2[:2])
    with pytest.raises(ValueError, match="kernel must be"):
        MLADecodePlan(q1, kv1, tables, lens_t, kv_lora_rank=rank, sm_scale=scale, out=out1, kernel="x")


def test_mla_decode_rejects_bad_inputs():
    q, kv, tables, lens = make_case([4], 4, 64, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(q, kv, tables, lens, kv_lora_rank=96, sm_scale=1.0)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, kv, tables.long(), lens, kv_lora_rank=64, sm_scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        mla_decode(q.half(), kv, tables, lens, kv_lora_rank=64, sm_scale=1.0)


def test_pick_num_splits():
    cpu = torch.device("cpu")  # the interpreter counts 4 SMs
    assert pick_num_splits(64, 1, 32768, cpu) == 1  # enough programs already
    assert pick_num_splits(1, 1, 32768, cpu) == 4  # one wave: 4 SMs x 1 program
    assert pick_num_splits(1, 1, 32768, cpu, programs_per_sm=2) == 8
    assert pick_num_splits(3, 1, 32768, cpu, programs_per_sm=2) == 2  # 6 of 8 slots, not 9
    assert pick_num_splits(1, 1, 64, cpu) == 1  # too short to split
    assert pick_num_splits(1, 1, 200, cpu) == 4  # a lone short sequence: 64-key splits


# ------------------------------------------------------------------ sm_90 SASS (CPU)
def _tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _compile_decode_sm90(cfg: MLADecodeConfig, cache_ty: str):
    """The main kernel for 16 heads of DeepSeek's 512 + 64 entry, pages of 64, no split,
    compiled for sm_90 as an H200 launch compiles it: pointers and the strides that are
    multiples of 16 there (all but the block table's) marked so (without those hints the
    address arithmetic differs and ptxas spills)."""
    from sm90 import compile_sm90

    from flashpage.kernels import mla_decode as md

    fn = md._mla_decode_kernel
    consts = dict(RANK=512, ROPE=64, BLOCK_R=512, BLOCK_P=64, BLOCK_H=cfg.block_h,
                  BLOCK_N=cfg.block_n, PAGE=64, SPLIT=False, FUSED=False, IEEE=False, PDL=False,
                  F16_DOTS=cache_ty != "*bf16", PREFETCH=cfg.prefetch, QK_CHUNKS=cfg.qk_chunks)
    types = {"kv_ptr": cache_ty, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "counter_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
             "sm_scale_log2": "fp32"}
    aligned = [a for a in fn.arg_names if a.endswith("_ptr") or a in (
        "stride_qb", "stride_qh", "stride_kvb", "stride_kvt", "stride_ob", "stride_oh")]
    return compile_sm90(fn, consts, types, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        aligned=aligned)


def qk_chain_ids(sass: str) -> list[int]:
    """For each HMMA of the loop's Q K^T (the loop's first HMMAs, up to its first FMNMX,
    the row max), the accumulator chain it extends: an HMMA whose accumulator input is
    the output of an earlier HMMA (not overwritten since) continues that one's chain;
    any other starts a new one. ``sass``: nvdisasm's listing."""
    ins, labels = sass_instructions(sass)
    loops = sass_loops(ins, labels)
    lo, hi = max(loops, key=lambda r: r[1] - r[0])  # the main loop: the longest one
    body = ins[lo:hi + 1]
    first = next(i for i, t in enumerate(body) if t.startswith("HMMA"))
    last = next(i for i in range(first, len(body)) if body[i].startswith("FMNMX"))
    owner: dict[str, int] = {}  # register -> chain whose HMMA wrote it last
    ids: list[int] = []
    n_chains = 0
    for t in body[first:last]:
        op, _, rest = t.partition(" ")
        regs = [a.strip().split(".")[0] for a in rest.split(",")]
        if op.startswith("HMMA"):  # HMMA D, A, B, C: D = A.B + C, D and C 4 registers each
            chain = owner.get(regs[3])
            if chain is None:
                chain, n_chains = n_chains, n_chains + 1
            ids.append(chain)
            d = int(regs[0][1:])
            owner.update({f"R{d + k}": chain for k in range(4)})
        elif rest and not op.startswith(("ST", "BAR", "RED", "ATOM")):
            owner.pop(regs[0], None)  # a destination other than an HMMA's
    return ids


SASS_CASES = {  # name -> (config, cache type): the Hopper defaults for 16 heads, chunked
    "bf16_c1": (replace(default_config(16), qk_chunks=1), "*bf16"),
    "bf16_c2": (replace(default_config(16), qk_chunks=2), "*bf16"),
    "bf16_c4": (replace(default_config(16), qk_chunks=4), "*bf16"),
    "fp8_c4": (replace(default_config(16, fp8=True), qk_chunks=4), "*fp8e4nv"),
}


def _sm90_qk_report() -> dict[str, dict]:
    """SASS_CASES compiled for sm_90: name -> Q K^T chain ids, registers, spill stack
    bytes and shared memory (run by run_compiled, the interpreter off)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cfg, cache_ty) in SASS_CASES.items():
            k = _compile_decode_sm90(cfg, cache_ty)
            cubin = Path(tmp) / f"{name}.cubin"
            cubin.write_bytes(k.asm["cubin"])
            sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True,
                                  text=True, check=True).stdout
            usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin],
                                   capture_output=True, text=True, check=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
            out[name] = dict(chains=qk_chain_ids(sass), regs=int(m[1]), stack=int(m[2]),
                             shared=k.metadata.shared)
    return out


def test_mla_decode_qk_chunks_sass():
    """Compiled for sm_90: unchunked, Q K^T is one chain of 36 HMMAs (576 / 16), each
    waiting for the previous one's accumulator; with NC chunks it is NC chains of
    512 / NC / 16 plus the rope dot's 4, and in the bf16 loop ptxas interleaves them
    (HMMAs next to each other rarely share a chain). Over bf16 the chunked loop spills
    nothing, needs fewer registers and no more shared memory."""
    if not (_tool("nvdisasm").exists() and _tool("cuobjdump").exists()):
        pytest.skip("no nvdisasm / cuobjdump in this Triton install")
    got = run_compiled("test_mla_decode", "_sm90_qk_report")
    assert got["bf16_c1"]["chains"] == [0] * 36, got["bf16_c1"]["chains"]
    for name, nc in (("bf16_c2", 2), ("bf16_c4", 4), ("fp8_c4", 4)):
        ids = got[name]["chains"]
        assert sorted(Counter(ids).values()) == sorted([4] + [32 // nc] * nc), (name, ids)
        if name.startswith("bf16"):
            same = sum(a == b for a, b in zip(ids[:-1], ids[1:], strict=True))
            assert same <= len(ids) // 4, f"{name}: chains not interleaved: {ids}"
            assert got[name]["stack"] == 0, f"{name} spills: {got[name]}"
            assert got[name]["regs"] < got["bf16_c1"]["regs"], got
            assert got[name]["shared"] <= got["bf16_c1"]["shared"], got


# ------------------------------------------------------------------ GPU, bf16
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize(
    "seq_lens",
    [
        [1],
        [4096],  # one long sequence: split along the keys
        [1, 17, 300, 2048, 1000, 64, 65, 5],  # ragged batch
        [513] * 64,  # many sequences: no split
    ],
)
def test_mla_decode_gpu_bf16(seq_lens, heads, page):
    check(seq_lens, heads, 512, 64, page, torch.bfloat16, "cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7, 32])
def test_mla_decode_gpu_forced_splits(num_splits):
    check([3000, 100, 1], 128, 512, 64, 16, torch.bfloat16, "cuda", num_splits=num_splits)


@gpu
@pytest.mark.gpu
def test_mla_decode_gpu_large_offsets():
    """A pool past 2^31 elements: block ids near the end need int64 offsets."""
    D, page = 576, 64
    num_blocks = (2**31) // (page * D) + 8  # ~2.4 GB of bf16
    kv = torch.empty(num_blocks, page, D, dtype=torch.bfloat16, device="cuda")
    kv[-4:].normal_()
    tables = torch.tensor([[num_blocks - 1, num_blocks - 3]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 16, D, dtype=torch.bfloat16, device="cuda")
    ref = mla_decode_ref(q, kv, tables, lens, kv_lora_rank=512, sm_scale=0.05).float()
    out = mla_decode(q, kv, tables, lens, kv_lora_rank=512, sm_scale=0.05).float()
    assert (out - ref).norm() / ref.norm() < REL_TOL[torch.bfloat16]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", CANDIDATE_CONFIGS, ids=config_name)
def test_mla_decode_gpu_configs(config):
    from triton.runtime.errors import OutOfResources

    heads = 16 if config.block_h == 16 else 128  # the head count each config is meant for
    for splits in (1, 3, 40):
        try:
            check([1, 700, 3000], heads, 512, 64, 64, torch.bfloat16, "cuda", num_splits=splits,
                  config=config)
        except OutOfResources as e:
            pytest.skip(f"{config} does not fit: {e}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 3, 4, 7, 40])
def test_mla_decode_gpu_fused_merge(num_splits):
    """The in-kernel merge on the GPU, where splits finish in any order."""
    from dataclasses import replace

    cfg = replace(default_config(16, torch.device("cuda")), fuse_merge_max_splits=64)
    check([1, 17, 300, 2048, 1000, 64, 65, 5] * 4, 16, 512, 64, 64, torch.bfloat16, "cuda",
          num_splits=num_splits, config=cfg)


@gpu
@pytest.mark.gpu
def test_mla_decode_gpu_fused_merge_graph_replays():
    """Captured once, replayed with new queries: the counters the kernel resets itself
    leave every replay as right as the first call."""
    from dataclasses import replace

    cfg = replace(default_config(16, torch.device("cuda")), fuse_merge_max_splits=64)
    q, kv, tables, lens = make_case([700, 3000, 1, 129] * 8, 16, 512, 64, 64, torch.bfloat16,
                                    "cuda")
    out = torch.empty(q.shape[0], 16, 512, dtype=q.dtype, device="cuda")

    def run():
        mla_decode(q, kv, tables, lens, kv_lora_rank=512, sm_scale=0.05, out=out, num_splits=4,
                   config=cfg)

    run()  # compile, and allocate the counters outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        ref = mla_decode_ref(q, kv, tables, lens, kv_lora_rank=512, sm_scale=0.05).float()
        assert (out.float() - ref).norm() / ref.norm() < REL_TOL[torch.bfloat16]
