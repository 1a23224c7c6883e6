"""MLA latent cache write in 16-byte units (kernels/mla_cache_write.py) against the torch
reference: every written slot equal bit for bit, every other slot untouched.

CPU (Triton interpreter): fp32 and fp16, DeepSeek's 576-wide rows contiguous and strided,
narrower and odd widths (units of 8, 4, 2 and 1 elements). GPU: bf16 with each
candidate tile, over a pool past 2^31 elements.
"""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.cache_write import write_mla_cache, write_mla_cache_ref
from flashpage.kernels.mla_cache_write import CANDIDATE_TILES, unit_elems, write_mla_cache_vec

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(n: int, width: int, pad: int, num_blocks: int, page: int, dtype: torch.dtype,
              device: str, num_skipped: int = 3, seed: int = 0):
    """latent [n, width] as a view of [n, width + pad] rows; random distinct slots, some -1."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, width + pad, generator=g).to(dtype).to(device)[:, :width]
    kv = torch.randn(num_blocks, page, width, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_blocks * page, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:num_skipped]] = -1
    return latent, kv, slots.to(device)


def check(latent, kv, slots, tile=None) -> None:
    ref = kv.clone()
    write_mla_cache_vec(latent, kv, slots, tile)
    write_mla_cache_ref(latent, ref, slots)
    assert torch.equal(kv, ref)  # written slots equal, and nothing else changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "width,pad,vec16",  # vec16: elements per unit for a 2-byte dtype
    [(576, 0, 8), (576, 8, 8), (576, 4, 4), (80, 0, 8), (72, 2, 2), (33, 0, 1)],
)
def test_write_mla_cache_vec(width, pad, vec16, dtype):
    latent, kv, slots = make_case(37, width, pad, 4, 16, dtype, "cpu")
    assert unit_elems(latent, kv) == min(vec16, 16 // latent.element_size())
    # 64 units per program: programs end mid-row, so a token's units span two programs.
    check(latent, kv, slots, tile=(64, 4))


def test_write_mla_cache_vec_default_tile():
    latent, kv, slots = make_case(29, 576, 0, 3, 16, torch.float16, "cpu", num_skipped=5)
    check(latent, kv, slots)


def test_write_mla_cache_dispatches_here(monkeypatch):
    """cache_write.write_mla_cache (what the backend calls) runs this kernel."""
    import flashpage.kernels.cache_write as cw

    calls = []
    monkeypatch.setattr(cw, "write_mla_cache_vec", lambda *a: calls.append(a))
    write_mla_cache(*make_case(4, 576, 0, 1, 16, torch.float32, "cpu", num_skipped=0))
    assert len(calls) == 1


def test_write_mla_cache_vec_rejects_bad_inputs():
    latent, kv, slots = make_case(4, 80, 0, 1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="latent must be"):
        write_mla_cache_vec(latent[:, :64], kv, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_mla_cache_vec(latent, kv, slots.int())
    with pytest.raises(ValueError, match="dtype mismatch"):
        write_mla_cache_vec(latent.half(), kv, slots)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tile", CANDIDATE_TILES, ids=lambda t: f"{t[0]}u{t[1]}w")
def test_write_mla_cache_vec_gpu_bf16(tile):
    for n, pad in ((1, 0), (3000, 0), (777, 64)):  # 777 rows of a wider projection output
        latent, kv, slots = make_case(n, 576, pad, 2 * n // 16 + 2, 16, torch.bfloat16, "cuda",
                                      num_skipped=min(n - 1, 40))
        check(latent, kv, slots, tile)


@gpu
@pytest.mark.gpu
def test_write_mla_cache_vec_gpu_pool_past_2_pow_31():
    page, width = 64, 576
    num_blocks = (1 << 31) // (page * width) + 4  # ~2.5 GB of bf16
    kv = torch.zeros(num_blocks, page, width, dtype=torch.bfloat16, device="cuda")
    latent = torch.randn(100, width, dtype=torch.bfloat16, device="cuda")
    slots = (num_blocks - 4) * page + torch.randperm(4 * page, device="cuda")[:100]
    write_mla_cache_vec(latent, kv, slots)
    assert torch.equal(kv.flatten(0, 1)[slots], latent)
