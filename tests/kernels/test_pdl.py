"""Programmatic dependent launch (kernels/pdl.py) in the decode-path kernels.

CPU: the switch is off on the CPU and under the interpreter whatever FLASHPAGE_PDL says,
the launchers still run (and match their references) with it set, and the sm_90 PTX of
every kernel compiled with PDL waits (griddepcontrol.wait) before its first global memory
access, except the loads a few make early of what no kernel of the step writes (weights,
norm weights, the cos/sin table; positions, slot mapping, sequence lengths and block
tables, written before the step's first kernel): loads only, never a store. GPU (Hopper): with PDL on, every kernel's output equals, bit for bit, its output
with PDL off, eagerly and in a CUDA graph chaining them (each consuming the one before),
replayed with new inputs, so a missing wait shows as a mismatch.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from sm90 import compile_sm90, run_compiled  # tests/kernels (on sys.path under pytest)

from flashpage.kernels import pdl as pdl_mod
from flashpage.kernels.layer_norm import layer_norm, layer_norm_ref
from flashpage.kernels.mla_decode import mla_decode, mla_decode_ref
from flashpage.kernels.paged_decode import DecodeConfig, _launch, paged_decode, paged_decode_ref
from flashpage.kernels.pdl import pdl_enabled, pdl_launch_kwargs, resolve_pdl
from flashpage.kernels.rms_norm import rms_norm, rms_norm_ref
from flashpage.kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    compute_cos_sin_cache,
    rotary_and_cache_write,
    rotary_and_cache_write_ref,
)
from flashpage.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
HOPPER = GPU and torch.cuda.get_device_capability()[0] >= 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of capability >= 9 (PDL)")


# ------------------------------------------------------------------ the switch


def test_pdl_off_on_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("FLASHPAGE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not pdl_enabled(torch.device("cpu"))
    assert not resolve_pdl(True, torch.device("cpu"))
    # Under the interpreter even a CUDA device says no (before asking the device anything).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))
    assert not resolve_pdl(True, torch.device("cuda", 0))
    assert not resolve_pdl(None, torch.device("cuda", 0))


def test_pdl_reads_the_variable_at_each_call(monkeypatch):
    monkeypatch.setattr(pdl_mod, "pdl_supported", lambda device: True)
    dev = torch.device("cuda", 0)
    monkeypatch.setenv("FLASHPAGE_PDL", "0")
    assert not pdl_enabled(dev) and not resolve_pdl(None, dev)
    assert resolve_pdl(True, dev)  # an explicit request ignores the variable
    monkeypatch.setenv("FLASHPAGE_PDL", "1")
    assert pdl_enabled(dev) and resolve_pdl(None, dev)
    assert not resolve_pdl(False, dev)
    monkeypatch.setenv("FLASHPAGE_PDL", "0")
    assert not pdl_enabled(dev)


def test_pdl_modes(monkeypatch):
    """FLASHPAGE_PDL: auto (the default) for kernels that take part in it (in_auto), all
    for every one, 0 for none; the unsplit paged decode and MLA decode stay out of auto."""
    from flashpage import envs

    monkeypatch.setattr(pdl_mod, "pdl_supported", lambda device: True)
    dev = torch.device("cuda", 0)
    for value, mode, auto_kernel, other_kernel in (("auto", "auto", True, False),
                                                   ("1", "all", True, True),
                                                   ("all", "all", True, True),
                                                   ("0", "0", False, False)):
        monkeypatch.setenv("FLASHPAGE_PDL", value)
        assert envs.pdl() == mode
        assert pdl_enabled(dev) is auto_kernel
        assert pdl_enabled(dev, in_auto=False) is other_kernel
        assert resolve_pdl(None, dev, in_auto=False) is other_kernel
        assert resolve_pdl(True, dev, in_auto=False)  # explicit: every mode
    monkeypatch.delenv("FLASHPAGE_PDL")
    assert envs.pdl() == "auto" and pdl_enabled(dev) and not pdl_enabled(dev, in_auto=False)
    monkeypatch.undo()
    assert not pdl_enabled(torch.device("cpu"))


def test_pdl_launch_kwargs():
    assert pdl_launch_kwargs(True) == {"launch_pdl": True}
    assert pdl_launch_kwargs(False) == {}


# ------------------------------------------------------------------ CPU: the launchers


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.skipif(GPU, reason="the interpreter's half of the test")
@pytest.mark.parametrize("pdl", [None, True])
def test_launchers_run_under_the_interpreter_with_pdl_set(monkeypatch, pdl):
    """FLASHPAGE_PDL=1 (and pdl=True) on the CPU: the flag stays off, the kernels run and
    match their references (fp32)."""
    monkeypatch.setenv("FLASHPAGE_PDL", "1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g)
    w = torch.randn(96, generator=g)
    r = torch.randn(3, 96, generator=g)
    assert _rel_err(rms_norm(x, w, 1e-6, pdl=pdl), rms_norm_ref(x, w, 1e-6)) < 1e-6
    out, res = rms_norm(x, w, 1e-6, r, pdl=pdl)
    out_ref, res_ref = rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, res_ref) and _rel_err(out, out_ref) < 1e-6
    out, res = layer_norm(x, w, r[0], 1e-6, r, pdl=pdl)
    out_ref, res_ref = layer_norm_ref(x, w, r[0], 1e-6, r)
    assert torch.equal(res, res_ref) and _rel_err(out, out_ref) < 1e-6
    assert _rel_err(silu_and_mul(x, pdl=pdl), silu_and_mul_ref(x)) < 1e-6

    n, hq, hkv, d, bs, nblk = 5, 4, 2, 32, 8, 4
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    pos = torch.randint(0, 64, (n,), generator=g)
    cs = compute_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 64)
    q1, k1 = apply_rotary(pos, q.clone(), k.clone(), cs, pdl=pdl)
    q2, k2 = apply_rotary_ref(pos, q.clone(), k.clone(), cs)
    assert _rel_err(q1, q2) < 1e-6 and _rel_err(k1, k2) < 1e-6
    kc, vc = torch.zeros(nblk, bs, hkv, d), torch.zeros(nblk, bs, hkv, d)
    slots = torch.tensor([3, -1, 9, 30, 17])
    caches = [kc.clone(), vc.clone()]
    q1, k1 = rotary_and_cache_write(pos, q.clone(), k.clone(), v, cs, kc, vc, slots, pdl=pdl)
    q2, k2 = rotary_and_cache_write_ref(pos, q.clone(), k.clone(), v, cs, *caches, slots)
    assert _rel_err(q1, q2) < 1e-6 and _rel_err(kc, caches[0]) < 1e-6
    assert torch.equal(vc, caches[1])

    # paged decode, unsplit and split (the merge kernel)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    tables = torch.tensor([[2, 0, 3], [1, 3, 3]], dtype=torch.int32)
    kc, vc = torch.randn(nblk, bs, hkv, 64, generator=g), torch.randn(nblk, bs, hkv, 64, generator=g)
    qd = torch.randn(2, hq, 64, generator=g)
    want = paged_decode_ref(qd, kc, vc, tables, lens)
    for splits in (1, 3):
        assert _rel_err(paged_decode(qd, kc, vc, tables, lens, num_splits=splits, pdl=pdl), want) < 1e-5

    # MLA decode, split (main kernel + merge kernel)
    rank, rope = 32, 16
    kv = torch.randn(nblk, bs, rank + rope, generator=g)
    qm = torch.randn(2, 16, rank + rope, generator=g)
    kw = dict(kv_lora_rank=rank, sm_scale=0.1)
    want = mla_decode_ref(qm, kv, tables, lens, **kw)
    assert _rel_err(mla_decode(qm, kv, tables, lens, num_splits=2, pdl=pdl, **kw), want) < 1e-5


# ------------------------------------------------------------------ CPU: the PTX

# A PTX instruction touching global memory (predicated or not): ld/st/atom/red/cp.async...
_GLOBAL_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp|prefetch)\.\S*global")
_WAIT = "griddepcontrol.wait"


def _compile_ptx() -> dict[str, str]:
    """Every decode-path kernel compiled for sm_90 with PDL=True: name -> PTX (no GPU needed,
    Triton ships ptxas; runs with the interpreter off, in a subprocess)."""
    from flashpage.kernels import gemv, moe_router
    from flashpage.kernels import layer_norm as ln
    from flashpage.kernels import mla_decode as mla
    from flashpage.kernels import paged_decode as pd
    from flashpage.kernels import paged_decode_rows as rows
    from flashpage.kernels import rms_norm as rn
    from flashpage.kernels import rotary as rot
    from flashpage.kernels import silu_mul as sm

    ptr = {"positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32",
           "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32",
           "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "logits_ptr": "*fp32", "bias_ptr": "*fp32",
           "weights_ptr": "*fp32", "ids_ptr": "*i64", "scale": "fp32", "alibi_ptr": "*fp32", "sinks_ptr": "*fp32"}
    kernels = {
        "rms_norm": (rn._rms_norm_kernel, dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True, W_FP32=False),
                     8, 3),
        "layer_norm": (ln._layer_norm_kernel, dict(
            WIDTH=4096, BLOCK=4096, BLOCK_R=1, HAS_WEIGHT=True, HAS_BIAS=True, HAS_RESIDUAL=True), 8, 3),
        "silu_mul": (sm._silu_and_mul_kernel, dict(BLOCK=1024, GELU_TANH=False), 4, 3),
        "rotary": (rot._rotary_kernel, dict(
            WRITE_CACHE=True, IS_NEOX=True, PAGE=16, HALF=64, HALF_PAD=64, HEAD_DIM=128,
            BLOCK_D=128, REST_PAD=1, BLOCK_HQ=32, BLOCK_HK=8), 4, 3),
        "paged_decode": (pd._paged_decode_kernel, dict(
            GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=64, SPLIT=True,
            HAS_WINDOW=False, IEEE=False, PREFETCH=False, HEADS_FASTEST=False, FUSED_MERGE=True,
            GROUP_PAD=4, MERGE_CHUNK=16, PREFETCH_V=False, F16_DOTS=False, WARP_SPLIT=False,
            SOFTCAP=False, ALIBI=False, SINKS=False, CHUNKED=False), 4, 5),
        "paged_decode_rows": (rows._paged_decode_rows_kernel, dict(
            GROUP=4, HPB=2, ROWS_PAD=16, HEAD_DIM=128, WIDTH=256, PAGE=16, BLOCK_N=32,
            SPLIT=True, HAS_WINDOW=False, IEEE=False, F16_DOTS=False), 4, 3),
        "paged_merge": (pd._merge_splits_kernel, dict(SPLITS_PAD=8, HEAD_DIM=128, BLOCK_D=128), 4, 3),
        "mla_decode": (mla._mla_decode_kernel, dict(
            RANK=512, ROPE=64, BLOCK_R=512, BLOCK_P=64, BLOCK_H=16, BLOCK_N=32, PAGE=64,
            SPLIT=True, FUSED=True, IEEE=False, F16_DOTS=False, PREFETCH=False, QK_CHUNKS=4), 4, 3),
        "mla_merge": (mla._mla_merge_kernel, dict(RANK=512, BLOCK_R=512, BLOCK_S=8, CHUNK_R=512), 4, 3),
        "gemv_row": (gemv._gemv_row_kernel, dict(
            HAS_BIAS=False, HAS_SCALE=False, SILU_MUL=False, NORM=True, HAS_RES=True, BLOCK_N=4,
            BLOCK_K=4096, WHOLE_ROW=True, SBN=0, SBK=0, TB=1), 4, 1),
        "moe_route": (moe_router._route_kernel, dict(
            TOP_K=8, K_PAD=8, TOPK_GROUP=4, GROUP_PAD=8, PER_PAD=32, METHOD=2, NORM_TOPK=True), 1, 1),
        "gemv_row_looped": (gemv._gemv_row_kernel, dict(
            HAS_BIAS=False, HAS_SCALE=False, SILU_MUL=True, NORM=False, HAS_RES=False, BLOCK_N=16,
            BLOCK_K=512, WHOLE_ROW=False, SBN=0, SBK=0, TB=1), 8, 1),
        # fp8 weights (w_ptr below): the row scales load before the wait too
        "gemv_row_fp8": (gemv._gemv_row_kernel, dict(
            HAS_BIAS=False, HAS_SCALE=True, SILU_MUL=False, NORM=True, HAS_RES=True, BLOCK_N=4,
            BLOCK_K=4096, WHOLE_ROW=True, SBN=0, SBK=0, TB=1), 4, 1),
        # block-scaled fp8 (kernels/fp8_block_gemm.py's layout): the tiles' scales too
        "gemv_row_fp8_block": (gemv._gemv_row_kernel, dict(
            HAS_BIAS=False, HAS_SCALE=True, SILU_MUL=False, NORM=True, HAS_RES=True, BLOCK_N=4,
            BLOCK_K=4096, WHOLE_ROW=True, SBN=128, SBK=128, TB=128), 4, 1),
    }
    out = {}
    for name, (fn, consts, warps, stages) in kernels.items():
        types = {**ptr, "eps": "fp32", "sm_scale_log2": "fp32", "s_ptr": "*fp32", "softcap": "fp32"}
        if "fp8" in name:
            types["w_ptr"] = "*fp8e4nv"
        k = compile_sm90(fn, {**consts, "PDL": True}, types,
                         num_warps=warps, num_stages=stages, launch_pdl=True)
        assert k.metadata.launch_pdl
        out[name] = k.asm["ptx"]
    return out


# Kernels that load, before the wait, what no kernel of a step writes (their launchers'
# docstrings say which); every other kernel waits before any global access.
_EARLY_LOADS = {"rms_norm", "layer_norm", "rotary", "paged_decode", "gemv_row", "gemv_row_looped", "gemv_row_fp8",
                "gemv_row_fp8_block", "moe_route"}


def test_ptx_waits_before_any_global_access():
    ptx = run_compiled("test_pdl", "_compile_ptx")
    assert len(ptx) == 14
    for name, text in ptx.items():
        lines = text.splitlines()
        waits = [i for i, line in enumerate(lines) if _WAIT in line]
        access = [i for i, line in enumerate(lines) if _GLOBAL_ACCESS.match(line)]
        assert len(waits) == 1, f"{name}: {len(waits)} waits"
        before = [lines[i] for i in access if i < waits[0]]
        after = [i for i in access if i > waits[0]]
        assert after, f"{name}: no global access after the wait"
        if name in _EARLY_LOADS:
            assert before, f"{name}: no early load (the test's list is stale)"
            assert all(re.match(r"^\s*(@!?%p\d+\s+)?ld\.global", line) for line in before), \
                f"{name}: a store or atomic before the wait"
        else:
            assert not before, f"{name}: a global access before the wait"
        # Dependents launch after the wait and before this kernel's first global store.
        stores = [i for i in after if re.match(r"^\s*(@!?%p\d+\s+)?(st|atom|red)\.", lines[i])]
        assert any("griddepcontrol.launch_dependents" in line for line in lines[waits[0]:stores[0]])


# ------------------------------------------------------------------ GPU: bit-exact on/off

HQ, HKV, D, BS = 32, 8, 128, 16


class DecodeChain:
    """rms_norm (+ residual) -> rotary + cache write -> paged_decode (split, merge kernel)
    -> silu_and_mul -> rms_norm, each consuming the one before, on static buffers."""

    def __init__(self, batch: int, ctx: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.batch, self.ctx = batch, ctx
        width = (HQ + 2 * HKV) * D
        self.x = torch.empty(batch, width, device="cuda", dtype=torch.bfloat16)
        self.res = torch.empty_like(self.x)
        self.w = torch.randn(width, generator=g, device="cuda").bfloat16()
        self.w2 = torch.randn(HQ * D // 2, generator=g, device="cuda").bfloat16()
        self.nblk = ctx // BS
        self.num_blocks = batch * self.nblk + 1
        self.kc0 = torch.randn(self.num_blocks, BS, HKV, D, generator=g, device="cuda").bfloat16()
        self.vc0 = torch.randn_like(self.kc0)
        self.kc, self.vc = self.kc0.clone(), self.vc0.clone()
        self.tables = torch.randperm(batch * self.nblk, generator=g, device="cuda").int()
        self.tables = self.tables.view(batch, self.nblk)
        self.lens = torch.empty(batch, dtype=torch.int32, device="cuda")
        self.pos = torch.empty(batch, dtype=torch.int64, device="cuda")
        self.slots = torch.empty(batch, dtype=torch.int64, device="cuda")
        inv = 1.0 / 500000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
        self.cos_sin = compute_cos_sin_cache(inv, ctx)

    def new_inputs(self, seed: int) -> None:
        """Random activations and lengths into the static buffers, the caches reset (the
        query's own key and value are written by the chain)."""
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.x.copy_(torch.randn(self.x.shape, generator=g, device="cuda"))
        self.res.copy_(torch.randn(self.res.shape, generator=g, device="cuda"))
        lens = torch.randint(1, self.ctx + 1, (self.batch,), generator=g, device="cuda")
        self.lens.copy_(lens)
        self.pos.copy_(lens - 1)
        blk = self.tables.gather(1, ((lens - 1) // BS)[:, None]).squeeze(1).long()
        self.slots.copy_(blk * BS + (lens - 1) % BS)
        self.kc.copy_(self.kc0)
        self.vc.copy_(self.vc0)

    def run(self, pdl: bool | None) -> dict[str, torch.Tensor]:
        h, res = rms_norm(self.x, self.w, 1e-5, self.res, pdl=pdl)
        q, k, v = h.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.view(-1, HQ, D), k.view(-1, HKV, D), v.view(-1, HKV, D)
        rotary_and_cache_write(self.pos, q, k, v, self.cos_sin, self.kc, self.vc, self.slots,
                               pdl=pdl)
        o = paged_decode(q, self.kc, self.vc, self.tables, self.lens, pdl=pdl)
        a = silu_and_mul(o.reshape(self.batch, HQ * D), pdl=pdl)
        y = rms_norm(a, self.w2, 1e-5, pdl=pdl)
        return dict(h=h, res=res, o=o, a=a, y=y, kc=self.kc, vc=self.vc)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs with PDL on"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("batch,ctx", [(1, 1024), (4, 4096), (64, 512)])
@pytest.mark.parametrize("mode", ["1", "auto"])
def test_decode_chain_pdl_equals_off(monkeypatch, batch, ctx, mode):
    """Eager, then a captured graph of the chain replayed with new inputs: PDL on (from
    FLASHPAGE_PDL=1, or =auto: the unsplit decode kernel without) gives exactly the
    PDL-off outputs."""
    monkeypatch.setenv("FLASHPAGE_PDL", mode)
    assert pdl_enabled(torch.device("cuda"))
    chain = DecodeChain(batch, ctx)
    chain.new_inputs(0)
    want = {n: t.clone() for n, t in chain.run(pdl=False).items()}
    ref = paged_decode_ref(want["h"][:, :HQ * D].view(-1, HQ, D), want["kc"], want["vc"],
                           chain.tables, chain.lens)
    assert ((want["o"].float() - ref.float()).norm() / ref.float().norm()).item() < 1.2e-2
    chain.new_inputs(0)  # the same inputs again
    _assert_equal(chain.run(pdl=None), want)

    # A graph of the chain with PDL on, replayed; each replay against eager PDL off.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain.run(pdl=None)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = chain.run(pdl=None)
    for i in range(5):
        chain.new_inputs(100 + i)
        graph.replay()
        got = {n: t.clone() for n, t in static.items()}
        chain.new_inputs(100 + i)
        _assert_equal(got, chain.run(pdl=False))
    torch.cuda.synchronize()


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("cfg", [DecodeConfig(64, 4, 3, programs_per_sm=2, fused_merge=True),
                                 DecodeConfig(32, 4, 3, heads_per_program=2),
                                 DecodeConfig(64, 4, 3, heads_fastest=True)],
                         ids=["fused_merge", "rows2", "heads_fastest"])
def test_paged_decode_variants_pdl_equals_off(cfg):
    """The other launch paths of paged_decode (in-kernel merge, rows kernel + merge)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    batch, ctx = 2, 4096
    kc = torch.randn(batch * ctx // BS, BS, HKV, D, generator=g, device="cuda").bfloat16()
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * ctx // BS, generator=g, device="cuda").int().view(batch, -1)
    lens = torch.tensor([ctx, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, generator=g, device="cuda").bfloat16()
    kw = dict(sm_scale=None, window_size=None, out=None, num_splits=8, config=cfg)
    want = _launch(q, kc, vc, tables, lens, pdl=False, **kw)
    for _ in range(3):
        assert torch.equal(_launch(q, kc, vc, tables, lens, pdl=True, **kw), want)
    ref = paged_decode_ref(q, kc, vc, tables, lens)
    assert ((want.float() - ref.float()).norm() / ref.float().norm()).item() < 1.2e-2


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("batch,ctx,splits", [(2, 8192, None), (8, 2048, 4), (1, 1024, 1)])
def test_mla_decode_pdl_equals_off(monkeypatch, batch, ctx, splits):
    """rms_norm -> mla_decode (split: main + merge kernel) -> silu_and_mul, eager and in a
    graph replayed with new inputs, PDL on against off."""
    monkeypatch.setenv("FLASHPAGE_PDL", "1")
    rank, rope, heads, page = 512, 64, 16, 64
    g = torch.Generator(device="cuda").manual_seed(2)
    nblk = ctx // page
    kv = torch.randn(batch * nblk, page, rank + rope, generator=g, device="cuda").bfloat16()
    tables = torch.randperm(batch * nblk, generator=g, device="cuda").int().view(batch, nblk)
    lens = torch.empty(batch, dtype=torch.int32, device="cuda")
    x = torch.empty(batch, heads * (rank + rope), device="cuda", dtype=torch.bfloat16)
    w = torch.randn(x.shape[1], generator=g, device="cuda").bfloat16()
    scale = 1.0 / math.sqrt(192)

    def new_inputs(seed):
        gi = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=gi, device="cuda"))
        lens.copy_(torch.randint(1, ctx + 1, (batch,), generator=gi, device="cuda"))

    def run(pdl):
        q = rms_norm(x, w, 1e-5, pdl=pdl).view(batch, heads, rank + rope)
        o = mla_decode(q, kv, tables, lens, kv_lora_rank=rank, sm_scale=scale,
                       num_splits=splits, pdl=pdl)
        return dict(o=o, a=silu_and_mul(o, pdl=pdl))

    new_inputs(0)
    want = run(False)
    _assert_equal(run(None), want)
    q = rms_norm(x, w, 1e-5).view(batch, heads, rank + rope)
    ref = mla_decode_ref(q, kv, tables, lens, kv_lora_rank=rank, sm_scale=scale).float()
    assert ((want["o"].float() - ref).norm() / ref.norm()).item() < 2e-2

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(None)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run(None)
    for i in range(5):
        new_inputs(100 + i)
        graph.replay()
        _assert_equal({n: t.clone() for n, t in static.items()}, run(False))
    torch.cuda.synchronize()
