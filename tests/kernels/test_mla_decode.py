"""MLA decode kernel against its pure-PyTorch reference.

CPU (Triton interpreter): fp32 and fp16, small ranks plus one case with DeepSeek's real
512 + 64 entry. GPU: bf16 over batch, context, heads (16, 128) and block size.
"""

from __future__ import annotations

import math

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


def test_mla_decode_fused_merge_threshold(monkeypatch):
    """Splits above fuse_merge_max_splits go through the merge kernel, at or below not."""
    import flashpage.kernels.mla_decode as mod

    launched = []
    real = mod._mla_merge_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(mod, "_mla_merge_kernel", Spy())
    cfg = MLADecodeConfig(block_h=16, block_n=16, fuse_merge_max_splits=2)
    check([40, 9], 16, 64, 16, 16, torch.float32, "cpu", num_splits=2, config=cfg)
    assert not launched
    check([40, 9], 16, 64, 16, 16, torch.float32, "cpu", num_splits=3, config=cfg)
    assert len(launched) == 1


@pytest.mark.parametrize("heads", [16, 70])
def test_mla_decode_default_configs(heads):
    """The GPU default tiles (64-entry tiles over 16-token pages for many heads)."""
    check([150, 3, 64], heads, 64, 16, 16, torch.float32, "cpu", num_splits=2,
          config=default_config(heads))


def test_mla_decode_non_pow2_rank():
    cfg = MLADecodeConfig(block_h=16, block_n=16)
    check([23, 9], 3, 48, 8, 4, torch.float32, "cpu", num_splits=2, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_decode_deepseek_dims(dtype):
    """DeepSeek-V2/V3 latent entry (512 + 64) with a tiny batch and context."""
    cfg = MLADecodeConfig(block_h=16, block_n=16)
    check([33, 7], 16, 512, 64, 16, dtype, "cpu", num_splits=2, config=cfg)


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
