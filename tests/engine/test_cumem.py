"""engine/cumem.py: allocations whose pages go back to the driver while their addresses
stay, so tensors and CUDA graphs over them survive (GPU only)."""

from __future__ import annotations

import pytest
import torch

from flashpage.engine import cumem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cumem.available(), reason="needs CUDA and torch's pluggable allocator")]


def test_unmapped_pages_go_back_and_a_graph_replays_after_remap():
    dev = torch.device("cuda")
    pool = cumem.CuMemPool(dev)
    with pool.use("weights"):
        w = torch.randn(2048, 2048, device=dev)
    with pool.use("kv_cache"):
        kv = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    assert pool.nbytes("weights") >= w.numel() * 4 and pool.nbytes("kv_cache") >= kv.numel()
    assert all(a.tag in ("weights", "kv_cache") for a in pool.allocations.values())
    held = pool.nbytes("weights")
    with pool.use("weights"):  # a temporary of the load, freed: its segment goes back on exit
        tmp = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
        assert pool.nbytes("weights") >= held + (32 << 20)
        del tmp
    assert pool.nbytes("weights") == held
    with pool.use("kv_cache"):  # never in a weights' segment (run 221: one pool for both)
        kv2 = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    assert [a.tag for a in pool.allocations.values()
            if a.ptr <= kv2.data_ptr() < a.ptr + a.size] == ["kv_cache"]
    x = torch.randn(2048, 16, device=dev)
    want = w @ x
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = w @ x  # warm cuBLAS outside the capture
        with torch.cuda.graph(g):
            y = w @ x
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.testing.assert_close(y, want)
    ptr, host = w.data_ptr(), w.cpu()
    free0 = torch.cuda.mem_get_info()[0]
    freed = pool.unmap("weights") + pool.unmap("kv_cache")
    assert freed >= w.numel() * 4 + kv.numel()
    assert torch.cuda.mem_get_info()[0] - free0 >= 0.9 * freed  # back to the driver
    assert pool.mapped_bytes("weights") == 0
    pool.remap("weights")
    pool.remap("kv_cache")
    assert w.data_ptr() == ptr
    w.copy_(host)
    kv.fill_(7)
    y.zero_()
    g.replay()  # the graph captured before the sleep reads the same addresses
    torch.testing.assert_close(y, want)
    assert int(kv[-1]) == 7
    # several sleeps: no growth of the pool, the pages given back each time
    for _ in range(3):
        pool.unmap("weights")
        pool.remap("weights")
    w.copy_(host)
    g.replay()
    torch.testing.assert_close(y, want)
