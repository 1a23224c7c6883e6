"""The wgmma MLA decode, keys as M (kernels/mla_decode_wgmma.py): a producer warpgroup and two
consumers; the triton backend's MLA decode for 16 heads on Hopper.

CPU: the kernel compiled for sm_90 (Triton's ptxas and nvdisasm): warpgroup MMAs m64n16k16
(S^T and O^T a tile, split between the consumers), TMA loads, one program an SM's shared
memory, no spill, registers set per warpgroup; the unsupported reasons, the split rule and the
ring's bounds. GPU (marked gpu, Hopper only; run under ``timeout``
and ``-x``: a wrong mbarrier phase hangs): against ``mla_decode_ref`` over the cases of
test_mla_decode_gluon (part tiles, ragged ends over NaN slots, padding rows), pages 16-128,
splits, few programs (many items each, the ring across items), slab rings of 18-23, 128 heads,
CUDA-graph replays and back-to-back calls (bitwise equal).
"""

from __future__ import annotations

import math

import pytest
import torch
from sm90 import ptxas_sm90a, ptxas_usage, run_compiled
from test_mla_decode_gluon import CASES, TOL, check_graph_replays, make_case, rel_err
from test_mla_decode_gluon import run_and_check as gluon_run_and_check

from flashpage.kernels.mla_decode import mla_decode_ref

GPU = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(GPU, reason="the sm_90 compile without a GPU")
hopper = pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")
RANK, ROPE = 512, 64


def compile_sm90(page: int = 64, split: bool = True):
    """The kernel compiled for sm_90 as an H200 launch compiles it (bf16; the pointers and the
    strides that are multiples of 16 there marked so)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashpage.kernels import mla_decode_wgmma as mw

    fn = mw._mla_decode_wgmma_kernel
    consts = {"PAGE": page, "SLOTS": mw.SLOTS, "SPLIT": split, "CONSUMER_REGS": mw.CONSUMER_REGS,
              "PRODUCER_REGS": mw.PRODUCER_REGS}
    options = dict(num_warps=mw.NUM_WARPS, maxnreg=mw.MAXNREG)
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({"q_ptr": "*bf16", "kv_desc": f"tensordesc<bf16[{min(page, 64)}, 64],{mw._SMEM.value!r}>",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "mid_o_ptr": "*fp32",
                "mid_lse_ptr": "*fp32", "qk_scale": "fp32"})
    sig.update({c: "constexpr" for c in consts})
    aligned = ("q_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr", "mid_o_ptr", "mid_lse_ptr",
               "stride_qb", "stride_qh", "stride_ob", "stride_oh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _sm90_report() -> dict:
    """(In a subprocess with the interpreter off.) Registers, spills, shared memory and the SASS
    counts at pages 16, 64, 128, split or not."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as ex:
        return {"skip": f"no Gluon in this Triton: {ex}"}
    out = {}
    for page, split in ((64, True), (64, False), (128, True), (16, True)):
        k = compile_sm90(page=page, split=split)
        log, sass = ptxas_sm90a(k.asm["ptx"])
        lines = sass.splitlines()
        count = {op: sum(f" {op} " in ln or f" {op}." in ln for ln in lines)
                 for op in ("HGMMA.64x16x16.F32.BF16", "UTMALDG.2D", "SYNCS.PHASECHK.TRANS64.TRYWAIT",
                            "USETMAXREG")}
        out[f"p{page}" + ("" if split else "_nosplit")] = dict(**ptxas_usage(log), shared=k.metadata.shared,
                                                              count=count, tma_ptx="cp.async.bulk.tensor" in k.asm["ptx"])
    return out


@cpu_only
def test_mla_wgmma_compiles_for_sm90():
    """One program an SM (shared memory under 227 KB, 384 threads x maxnreg registers), no spill,
    TMA loads; wgmma m64n16k16 in the SASS (a tile's S^T and O^T: 9 + 8 groups of 4 k-steps,
    split between the consumers); mbarrier waits; 9 boxes a tile issued at one site (36 from
    16-key pages, one a page); the registers set per warpgroup (setmaxnreg)."""
    from flashpage.kernels import mla_decode_wgmma as mw

    rep = run_compiled("test_mla_decode_wgmma", "_sm90_report")
    if "skip" in rep:
        pytest.skip(rep["skip"])
    for name, r in rep.items():
        print(f"{name}: {r['regs']} registers, {r['spill_bytes']} bytes spilled, {r['shared']} B shared, {r['count']}")
        assert r["tma_ptx"], name
        assert r["spill_bytes"] == 0, name
        assert r["regs"] <= mw.MAXNREG and r["shared"] + 1024 <= 227 * 1024, name
        assert r["count"]["HGMMA.64x16x16.F32.BF16"] >= (9 + 8) * 4, name
        assert r["count"]["SYNCS.PHASECHK.TRANS64.TRYWAIT"] >= 3, name  # ready, empty, the S exchange
        assert r["count"]["UTMALDG.2D"] == 9 * (4 if name.startswith("p16") else 1), name
        assert r["count"]["USETMAXREG"] > 0, name


def test_mla_wgmma_unsupported_reasons():
    """The Gluon MLA kernel's reasons: no GPU here, and a block size that is not a power of two."""
    from flashpage.kernels.mla_decode_wgmma import mla_wgmma_unsupported, pick_splits

    q = torch.zeros(2, 16, RANK + ROPE, dtype=torch.bfloat16)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    for page, bad in ((16, False), (64, False), (48, True)):
        why = mla_wgmma_unsupported(q, torch.zeros(8, page, RANK + ROPE, dtype=torch.bfloat16), tables, lens,
                                    kv_lora_rank=RANK)
        assert any("CUDA" in w for w in why)
        assert any("power of two" in w for w in why) == bad, (page, why)
    # splits: fill the programs, each split >= 64 keys, no split left empty by the 64-key rounding
    assert pick_splits(8, 1, 32768, 132) == 16
    assert pick_splits(128, 1, 4096, 132) == 1
    assert pick_splits(1, 1, 1024, 132) == 16
    assert pick_splits(1, 1, 32768, 132) == 128  # shares of 256 keys (249 rounded up)
    assert pick_splits(4, 1, 8192, 132) == 32
    assert pick_splits(1, 1, 1024, 132, min_split_keys=512) == 2
    assert pick_splits(3, 1, 100, 132) == 2  # 64 and 36 keys


# --------------------------------------------------------------------------- GPU


def run_and_check(lens, heads=16, page=64, seed=0, **kw):
    from flashpage.kernels.mla_decode_wgmma import mla_decode_wgmma

    return gluon_run_and_check(lens, heads, page, seed, entry=mla_decode_wgmma, **kw)


KNOBS = {
    "default": {},
    "nosplit": {"num_splits": 1},
    "splits3": {"num_splits": 3},
    "splits40": {"num_splits": 40},  # most splits of the short sequences empty
    "p1": {"programs": 1},  # one program: every item through one ring
    "p3_splits9": {"programs": 3, "num_splits": 9},
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("knob", list(KNOBS))
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_mla_wgmma_gpu(case, page, knob):
    """Against the reference per sequence, out starting NaN (every row written)."""
    run_and_check(CASES[case], page=page, **KNOBS[knob])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("page", [16, 64])
def test_mla_wgmma_128_heads_gpu(page):
    """128 heads: 8 head groups of 16, each its own items."""
    run_and_check([1, 100, 3000, 257], heads=128, page=page)
    run_and_check([5000, 7, 300], heads=128, page=page, num_splits=5, programs=13)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("slots", [18, 20, 22])
@pytest.mark.parametrize("page", [16, 64])
def test_mla_wgmma_slots_gpu(page, slots):
    """Slab rings of other sizes (18: two whole tiles; 20, 22: a tile's slabs wrapping at odd
    places), with one program walking every item and with splits."""
    for kw in ({}, {"programs": 1}, {"num_splits": 9, "programs": 3}):
        run_and_check([1, 100, 3000, 257, 64, 65], page=page, slots=slots, **kw)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("num_splits", [1, 7])
def test_mla_wgmma_plan_serves_every_layer_gpu(num_splits):
    """An MLADecodePlan on the wgmma kernel (as the triton backend plans it once a step, the
    launches after the first bound past Triton's dispatch, one descriptor per cache kept in the
    caller's dict) over three layers' queries and caches: each as the kernel's function gives,
    bitwise, and right against the reference."""
    from flashpage.kernels.mla_decode import MLADecodePlan
    from flashpage.kernels.mla_decode_wgmma import mla_decode_wgmma

    lens = [3000, 1, 2048, 777, 0, 65]
    q, kv, tables, seq_lens = make_case(lens, 16, 64, seed=5)
    layers = [(q, kv)]
    for _ in range(2):  # two more layers: other queries, other latents in the same blocks
        layers.append((torch.randn_like(q), torch.where(kv.isnan(), kv, torch.randn_like(kv))))
    scale = 1.0 / math.sqrt(RANK + ROPE)
    descriptors: dict = {}
    out0 = torch.empty(len(lens), 16, RANK, dtype=torch.bfloat16, device="cuda")
    plan = MLADecodePlan(q, kv, tables, seq_lens, kv_lora_rank=RANK, sm_scale=scale, out=out0,
                         kernel="wgmma", descriptors=descriptors)
    for _ in range(2):  # the second round: every launch bound
        for lq, lkv in layers:
            out = torch.full_like(out0, float("nan"))
            plan.run(lq, lkv, lkv, out)
            want = mla_decode_wgmma(lq, lkv, tables, seq_lens, kv_lora_rank=RANK, sm_scale=scale,
                                    num_splits=None)
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            assert rel_err(out, mla_decode_ref(lq, lkv, tables, seq_lens, kv_lora_rank=RANK,
                                               sm_scale=scale)) < TOL
    assert len(descriptors) == len(layers)


def test_mla_wgmma_slots_checked():
    """A slab ring outside 18..23 is an error naming the value, before any launch."""
    from flashpage.kernels.mla_decode_wgmma import mla_decode_wgmma

    q = torch.zeros(1, 16, RANK + ROPE, dtype=torch.bfloat16)
    args = (q, torch.zeros(2, 64, RANK + ROPE, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))
    for bad in (17, 24):
        with pytest.raises(ValueError, match=f"slots must be in 18..23, got {bad}"):
            mla_decode_wgmma(*args, kv_lora_rank=RANK, sm_scale=1.0, slots=bad)


@pytest.mark.gpu
@hopper
def test_mla_wgmma_many_calls_and_graph_gpu():
    """200 calls back to back, every one right and bitwise equal; then captured once in a CUDA
    graph and replayed with new queries and lengths (a padding row among them), every replay right."""
    from flashpage.kernels.mla_decode_wgmma import mla_decode_wgmma

    q, kv, tables, seq_lens = make_case([3000, 1, 2048, 777] * 4, 16, 64, seed=3)
    scale = 1.0 / math.sqrt(RANK + ROPE)
    ref = mla_decode_ref(q, kv, tables, seq_lens, kv_lora_rank=RANK, sm_scale=scale)
    outs = [mla_decode_wgmma(q, kv, tables, seq_lens, kv_lora_rank=RANK, sm_scale=scale) for _ in range(200)]
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert rel_err(o, ref) < TOL, f"call {i}"
        assert torch.equal(o, outs[0]), f"call {i} differs from call 0"

    check_graph_replays(lambda q, kv, tables, seq_lens, out, scale: mla_decode_wgmma(
        q, kv, tables, seq_lens, kv_lora_rank=RANK, sm_scale=scale, out=out, num_splits=7), replays=30)
