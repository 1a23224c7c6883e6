"""The Gluon FA3-style prefill (kernels/flash_prefill_gluon.py).

CPU: the kernel compiled for sm_90 (Triton's ptxas and nvdisasm, no GPU), its SASS read by
partition (each partition starts with a USETMAXREG): the producer issues every TMA load
(UTMALDG) under 24 registers, the consumers every wgmma (HGMMA) under 240, 16 HGMMA
m64n128k16 per key tile and consumer (8 for S = Q K^T, 8 for O += P V), no spill, no
bar.sync of the whole CTA inside a loop; ptxas reports no serialised wgmma (C7514). With
PV_OVERLAP (the default) every exp2 of a tile lies before the ``wait 0`` of P_{j-1} V_{j-1}
(the intra-warpgroup overlap); without it ptxas hoists that wait above the unmasked softmax
(0 of 64, printed). Bad input gets a ValueError.
GPU (marked gpu, sm_90 only): bf16 against the fp32 reference of flash_prefill.py over causal
and full attention, ragged lengths (1, tile edges, non-multiples), GQA 1 / 4 / 8, and the lse,
per schedule (one program per tile, static, snake, then dynamic: the one that could hang
last); each launcher knob; the dynamic schedules under CUDA-graph replay.
Paged (paged_prefill_gluon; ``-k paged``): against paged_prefill_ref over block sizes 16-256,
cached prefixes 0 to 4000, query counts from 1, GQA 1 / 4 / 8, a pool whose unowned slots and
table entries past each context are NaN, causal (static schedules first, then dynamic) and
full; the knobs; strided fp16 q against the Triton kernel; one compile for every
block_tables[nd:] offset; flash_prefill.paged_prefill's dispatch under
FLASHPAGE_PREFILL_GLUON=1. CPU: the paged variants' sm_90 SASS (above), bad input, the
reasons function, the GPU tests' cache builder.

    timeout 200 python -m pytest -q -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k paged
"""

from __future__ import annotations

import collections

import pytest
import torch
from sm90 import (  # tests/kernels (on sys.path under pytest)
    ptxas_sm90a,
    ptxas_usage,
    register_budgets,
    registers_used,
    run_compiled,
    sass_instructions,
    sass_loops,
)

GPU = torch.cuda.is_available()
HOPPER = GPU and torch.cuda.get_device_capability()[0] == 9
cpu_only = pytest.mark.skipif(GPU, reason="the sm_90 compile without a GPU")
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")

# --------------------------------------------------------------------------- sm_90 compile (CPU)

VARIANTS = {  # name -> constexprs besides the defaults (dynamic schedule, PV overlap)
    "causal": dict(CAUSAL=True, PINGPONG=True),
    "full": dict(CAUSAL=False, PINGPONG=True),
    "causal_lse_no_pingpong": dict(CAUSAL=True, PINGPONG=False, RETURN_LSE=True),
    "static_no_overlap": dict(CAUSAL=True, SCHEDULE=0, PV_OVERLAP=False, Q_BUFS=1),  # run 72's
    # paged_prefill_gluon: K/V gathered from a cache of block size PAGE in PIECE-row boxes
    "paged16": dict(CAUSAL=True, PINGPONG=True, PAGED=True, PAGE=16, PIECE=16),
    "paged128_q1": dict(CAUSAL=True, PINGPONG=True, PAGED=True, PAGE=128, PIECE=128, Q_BUFS=1),
    "paged64_full_static": dict(CAUSAL=False, PINGPONG=True, PAGED=True, PAGE=64, PIECE=64,
                                SCHEDULE=0),
    # producer="gather": cp.async rows (PAGED 2), consumers at 224 registers, producer 56
    "gather16": dict(CAUSAL=True, PINGPONG=True, PAGED=2, PAGE=16, PIECE=16, CONSUMER_REGS=224),
    "gather64_full_static_lse": dict(CAUSAL=False, PINGPONG=True, PAGED=2, PAGE=64, PIECE=64,
                                     SCHEDULE=0, RETURN_LSE=True, CONSUMER_REGS=224),
    # producer="tma1": paged16's boxes from a producer of one warp (PRODUCER_WARPS 1)
    "tma1_16": dict(CAUSAL=True, PINGPONG=True, PAGED=True, PAGE=16, PIECE=16, PRODUCER_WARPS=1),
    "tma1_128_full_static": dict(CAUSAL=False, PINGPONG=True, PAGED=True, PAGE=128, PIECE=128,
                                 SCHEDULE=0, PRODUCER_WARPS=1),
}


def compile_sm90(**consts):
    """The kernel compiled for sm_90 as the launcher compiles it on an H200 (bf16, out and
    lse pointers and out's strides 16-aligned): Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashpage.kernels import flash_prefill_gluon as fg

    fn = fg._flash_prefill_gluon_kernel
    consts = {"CAUSAL": True, "RETURN_LSE": False, "PINGPONG": True, "PV_OVERLAP": True,
              "SCHEDULE": fg.DYNAMIC, "NUM_STAGES": fg.STAGES, "Q_BUFS": 2,
              "CONSUMER_REGS": fg.CONSUMER_REGS, "PAGED": fg.CONTIGUOUS, "PAGE": 1,
              "PIECE": fg.BLOCK_N, "SLOT64": False, "PRODUCER_WARPS": 4, **consts}
    layout = repr(fg._SMEM.value)
    box = consts["PIECE"]  # rows of a K/V box (paged: min(block size, 128))
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({"q_desc": f"tensordesc<bf16[{fg.WG_M}, {fg.HEAD_DIM}],{layout}>",
                "k_desc": f"tensordesc<bf16[{box}, {fg.HEAD_DIM}],{layout}>",
                "v_desc": f"tensordesc<bf16[{box}, {fg.HEAD_DIM}],{layout}>",
                "out_ptr": "*bf16", "lse_ptr": "*fp32", "cu_seqlens_ptr": "*i32", "sched_ptr": "*i32",
                "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "qk_scale": "fp32",
                "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"})
    sig.update({c: "constexpr" for c in consts})
    aligned = ("out_ptr", "lse_ptr", "cu_seqlens_ptr", "sched_ptr", "stride_ot", "stride_oh",
               "k_cache_ptr", "v_cache_ptr", "stride_slot")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=fg.MAXNREG))


def sass_partitions(sass: str) -> dict:
    """The SASS by partition: each instruction's register budget is that of the last
    USETMAXREG before it; the loops are the backward branches before the last EXIT (the
    mbarrier retry stubs after it excluded), innermost, holding no USETMAXREG. Returns the opcode mix of
    each loop holding an HGMMA (``consumer``) or a TMA issue (``producer``), the budgets
    under which UTMALDG and HGMMA occur, the highest register used under each budget."""
    ins, labels = sass_instructions(sass)
    budget = register_budgets(ins)
    last_exit = max(i for i, t in enumerate(ins) if t.startswith("EXIT"))
    loops = sass_loops(ins, labels, last_exit)
    # innermost loops only (the work-tile loops around them hold them whole)
    loops = [(lo, hi) for lo, hi in loops
             if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops)]
    out: dict = {"consumer": [], "producer": []}
    for lo, hi in loops:
        body = ins[lo:hi + 1]
        ops = [t.split(" ")[0] for t in body]
        if any(o.startswith("USETMAXREG") for o in ops):
            continue  # the workers' dispatch loop, around the partitions
        mix: dict = dict(collections.Counter(ops))
        mix["total"] = len(ops)
        mix["budget"] = budget[lo]
        # bar.sync of the whole CTA (no thread count) vs a partition's named barrier (0x80)
        mix["cta_bar"] = sum(1 for t in body if t.startswith("BAR.SYNC") and "," not in t)
        mix["named_bar"] = sum(1 for t in body if t.startswith("BAR.SYNC") and "0x80" in t)
        mix["bar_sync"] = sum(1 for t in body if t.startswith("BAR.SYNC"))  # any thread count
        # the wgmma waits: 'gsb0, 0x1' = S_j done while P.V is in flight, 'gsb0, 0x0' = all
        mix["wait1"] = sum(1 for t in body if t.startswith("WARPGROUP.DEPBAR") and t.endswith("0x1"))
        mix["wait0"] = sum(1 for t in body if t.startswith("WARPGROUP.DEPBAR") and t.endswith("0x0"))
        # how much of the softmax ptxas left between 'wait 1' and 'wait 0' (under P_{j-1} V_{j-1})
        w0 = next((i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR") and t.endswith("0x0")), 0)
        mix["ex2_before_wait0"] = sum(1 for t in body[:w0] if t.startswith("MUFU.EX2"))
        if any(o.startswith("HGMMA") for o in ops):
            out["consumer"].append(mix)
        elif "UTMALDG.2D" in ops or "LDGSTS.E.BYPASS.128" in ops:
            out["producer"].append(mix)
    out["utmaldg_budgets"] = sorted({budget[i] for i, t in enumerate(ins) if t.startswith("UTMALDG")})
    out["hgmma_budgets"] = sorted({budget[i] for i, t in enumerate(ins) if t.startswith("HGMMA")})
    out["hgmma_shapes"] = sorted({t.split(" ")[0] for t in ins if t.startswith("HGMMA")})
    out["registers_used"] = registers_used(ins, budget)
    return out


def _sm90_report() -> dict:
    """(In a subprocess with the interpreter off.) Per variant: ptxas -v's registers, spills
    and warnings, shared memory, threads, and the partitions' SASS. {"skip": why} where
    Gluon cannot compile."""
    import triton

    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as ex:
        return {"skip": f"no Gluon in this Triton: {ex}"}
    out = {}
    for name, consts in VARIANTS.items():
        k = compile_sm90(**consts)
        log, sass = ptxas_sm90a(k.asm["ptx"])
        # a warning, or ptxas serialising the wgmmas ("(C7514) Potential Performance Loss: ...")
        warnings = [ln for ln in log.splitlines()
                    if "warning" in ln.lower() or "Potential Performance Loss" in ln]
        gather = consts.get("PAGED", 0) == 2
        out[name] = dict(**ptxas_usage(log), shared=k.metadata.shared,
                         pv_overlap=consts.get("PV_OVERLAP", True), gather=gather,
                         boxes=0 if gather else 128 // consts.get("PIECE", 128),
                         paged=bool(consts.get("PAGED", False)),
                         consumer_regs=consts.get("CONSUMER_REGS", 240),
                         producer_warps=consts.get("PRODUCER_WARPS", 4),
                         threads=32 * k.metadata.num_warps, warnings=warnings,
                         **sass_partitions(sass))
    return out


@cpu_only
def test_gluon_prefill_compiles_for_sm90():
    """3 warpgroups (384 threads) under maxnreg 168; the producer's warpgroup (24 registers,
    56 for the gather producer whose consumers take 224) issues every TMA load, the
    consumers (240 / 224) every wgmma (m64n128k16, 16 per key tile: the unmasked and the
    masked loop of each of the two consumers), no spill in a loop, no ptxas warning (a
    serialised wgmma would say so), no CTA-wide bar.sync in any loop, one ``wait 1`` per
    tile (S_j waited for while P_{j-1} V_{j-1} runs), and with PV_OVERLAP every exp2 of the
    tile before its ``wait 0``; the gather producer: 32 cp.async (LDGSTS) a key tile, 16
    block-table loads, two mbarrier arrives, no TMA box of K or V, and one proxy fence a
    tile in each consumer loop; the one-warp TMA producer (tma1): no bar.sync in its loop,
    fewer instructions than the 4-warp one's, the consumers' loops as with it; prints the
    loops' mixes."""
    from flashpage.kernels import flash_prefill_gluon as fg

    rep = run_compiled("test_flash_prefill_gluon", "_sm90_report")
    if "skip" in rep:
        pytest.skip(rep["skip"])
    for name, r in rep.items():
        print(f"{name}: {r['regs']} registers x {r['threads']} threads, {r['spill_bytes']} B spilled, "
              f"{r['shared']} B shared, warnings {r['warnings']}")
        for key in ("utmaldg_budgets", "hgmma_budgets", "hgmma_shapes", "registers_used"):
            print(f"  {key}: {r[key]}")
        for c in r["consumer"]:
            print(f"  consumer loop: {c}")
        for p in r["producer"]:
            print(f"  producer loop: {p}")
    assert (fg.MAXNREG * 384 - 2 * 128 * fg.CONSUMER_REGS) // 128 == 24
    assert fg.GATHER_CONSUMER_REGS == 224
    for name, r in rep.items():
        consumer_regs = r["consumer_regs"]
        producer_regs = (fg.MAXNREG * 384 - 2 * 128 * consumer_regs) // 128
        assert r["threads"] == 384 and r["regs"] == fg.MAXNREG, name
        assert not r["warnings"], (name, r["warnings"])
        # paged16 (causal, two Q buffers): ptxas keeps one work-tile invariant of the
        # consumers (128 num_m - 127) in local memory, stored before the partitions and
        # loaded once per work tile (12 B); gather64_full (consumers at 224, full attention:
        # 222 used) a few such values (24 B); never inside a loop (below)
        # tma1 (consumer 0 the default partition): 36 B (block 16), 52 (128, full, static): such values of both
        # consumers and one of the producer, each loaded once per work tile or once
        allowed = (32 if r["gather"] and "full" in name else 64 if r["producer_warps"] == 1
                   else 16 if r["boxes"] > 1 else 0)
        assert r["spill_bytes"] <= allowed, (name, r["spill_bytes"])
        for loop in r["consumer"] + r["producer"]:
            assert "LDL" not in loop and "STL" not in loop, name
        assert r["shared"] <= 227 * 1024, name
        assert r["hgmma_shapes"] == ["HGMMA.64x128x16.F32.BF16"], name
        assert r["utmaldg_budgets"] == [producer_regs], name  # every TMA issue is the producer's
        assert r["hgmma_budgets"] == [consumer_regs], name  # every wgmma a consumer's
        assert r["registers_used"][str(consumer_regs)] <= consumer_regs, name
        assert r["registers_used"][str(producer_regs)] <= producer_regs, name
        assert len(r["consumer"]) == 4, name  # 2 consumers x (unmasked, masked) loops
        for c in r["consumer"]:
            assert c["budget"] == consumer_regs
            assert c["HGMMA.64x128x16.F32.BF16"] == 16  # S: 128 / 16 k-steps, P.V: 128 / 16
            assert "UTMALDG.2D" not in c and c["cta_bar"] == 0
            assert c["wait1"] == 1 and c["wait0"] == 1  # not serialised: one wait of each a tile
            assert c["MUFU.EX2"] >= 64  # 64 scores a thread per tile
            if r["pv_overlap"]:  # the whole softmax of S_j under P_{j-1} V_{j-1}
                assert c["ex2_before_wait0"] >= 64, (name, c["ex2_before_wait0"])
            # gather: K_j and V_{j-1} made visible to the wgmma's async proxy, once a tile
            assert c.get("FENCE.VIEW.ASYNC.S", 0) == (1 if r["gather"] else 0), name
        assert len(r["producer"]) == 1, name
        p = r["producer"][0]
        assert p["budget"] == producer_regs, name
        assert not any(o.startswith("HGMMA") for o in p)
        if r["gather"]:
            # K_j and V_j: 16 chunks of 16 bytes a thread each, from the 16 rows' block-table
            # entries loaded once (for both) before the slot wait; one noinc arrive each; the
            # Q boxes (j = 0) in the loop or outside it; no bar.sync of the CTA
            assert p["LDGSTS.E.BYPASS.128"] == 32, name
            assert p["LDG.E"] == 16, name
            assert p["ARRIVES.LDGSTSBAR.64.ARVCNT"] == 2, name
            assert p.get("UTMALDG.2D", 0) in (0, 2), name
            assert p["cta_bar"] == 0, name
            continue
        if r["producer_warps"] == 1:
            # one warp issues both 64-column halves of every box: 2 UTMALDG a box (4 for Q's
            # two boxes, j = 0, in the loop or not), and no bar.sync at all between them
            assert p["UTMALDG.2D"] in (4 * r["boxes"], 4 * r["boxes"] + 4), (name, p["UTMALDG.2D"])
            assert p["bar_sync"] == 0, (name, p["bar_sync"])
        else:
            # K_j and V_j: one UTMALDG a box each (a box's two 64-column halves issued by two
            # warps; paged: 128 / PIECE boxes a tile); the Q load of j = 0 outside the
            # innermost loop, or inside it (2 more: paged16)
            assert p["UTMALDG.2D"] in (2 * r["boxes"], 2 * r["boxes"] + 2), (name, p["UTMALDG.2D"])
        if r["paged"]:
            # a tile's block-table entries: one load a thread (lane p: box p's), before the
            # wait for the ring slot; each box's row taken from its lane by shuffles (3 a
            # box of 16 rows: 8 lanes), shared by K and V
            assert p["LDG.E"] == 1, name
            assert p.get("SHFL.BFLY", 0) == {1: 0, 2: 2, 4: 8, 8: 24}[r["boxes"]], name
    # producer="tma1" against the 4-warp producer of the same case (block 16, causal,
    # dynamic): the producer's loop with no bar.sync (20 named ones in paged16's) and fewer
    # instructions (sm_90 SASS, Triton 3.6: 384 against 462); the consumers' loops the same
    # wgmmas, waits and exp2, within a few instructions (consumer 0 the default partition:
    # a thread-index read and 2 moves more a tile)
    one, four = rep["tma1_16"], rep["paged16"]
    assert four["producer"][0]["bar_sync"] >= 16 and one["producer"][0]["bar_sync"] == 0
    assert one["producer"][0]["total"] < four["producer"][0]["total"] - 50, (
        one["producer"][0]["total"], four["producer"][0]["total"])
    for c1, c4 in zip(one["consumer"], four["consumer"], strict=True):
        for op in ("HGMMA.64x128x16.F32.BF16", "MUFU.EX2", "wait1", "wait0", "ex2_before_wait0",
                   "bar_sync", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "SYNCS.ARRIVE.TRANS64.A1T0"):
            assert c1.get(op, 0) == c4.get(op, 0), (op, c1.get(op, 0), c4.get(op, 0))
        assert c4["total"] <= c1["total"] <= c4["total"] + 8, (c1["total"], c4["total"])


def test_default_head_group():
    """The fewest (head, sequence) pairs, a divisor of all of them, whose query tiles fill
    132 SMs once; all pairs when none does."""
    from flashpage.kernels.flash_prefill_gluon import default_head_group

    assert default_head_group(32, 64, 132) == 8  # 2 x 4096, 32 heads
    assert default_head_group(128, 32, 132) == 2  # 1 x 16384
    assert default_head_group(8, 256, 132) == 32  # 8 x 1024
    assert default_head_group(40, 96, 132) == 4  # 3 x 5000: 40 tiles a pair, 4 pairs >= 132
    assert default_head_group(1, 3, 132) == 3


def test_sched_buffers_apart(monkeypatch):
    """The self-zeroing dynamic schedule's counter buffer is its own: a dynamic_memset launch
    leaves its counter at the work size (zeroed only by the memset before its own next
    launch), so a shared buffer made the next dynamic launch skip tiles (gpu_run1's NaN).
    One buffer per (device, self-zeroing?), the same one on every call."""
    from flashpage.kernels import flash_prefill_gluon as fg

    monkeypatch.setattr(fg, "_SCHED_BUFFERS", {})
    cpu = torch.device("cpu")
    dyn = fg._sched_buffer(cpu, 4, fg.DYNAMIC)
    memset = fg._sched_buffer(cpu, 4, fg.DYNAMIC_MEMSET)
    assert dyn.data_ptr() != memset.data_ptr()
    assert dyn.shape == (2 + 2 * 4,) and dyn.dtype == torch.int32 and not dyn.any()
    assert fg._sched_buffer(cpu, 4, fg.DYNAMIC) is dyn
    for code in (fg.STATIC, fg.SNAKE):  # never written: any but the dynamic one's
        assert fg._sched_buffer(cpu, 4, code) is memset
    assert fg._SCHED_BUFFERS[cpu, True] is dyn


def test_tma_map_cache_cpu():
    """tma_maps.cached_tma_maps: within it the encoder runs once per distinct argument tuple
    (lists keyed by value), LRU past CAPACITY, the plain encoder back after (also on an
    exception), nested uses and enabled=False leave it alone."""
    import types

    from flashpage.kernels import tma_maps

    calls = []

    def fill(ptr, swizzle, elem, dtype, box, shape, strides, pad):
        calls.append(ptr)
        return ("map", ptr, tuple(box), tuple(shape), tuple(strides))

    utils = types.SimpleNamespace(fill_tma_descriptor=fill)
    tma_maps.clear()
    args = (4096, 3, 2, 10, [128, 64], [1000, 512], [512, 1], 0)
    with tma_maps.cached_tma_maps(utils):
        first = utils.fill_tma_descriptor(*args)
        assert utils.fill_tma_descriptor(*args) is first
        with tma_maps.cached_tma_maps(utils):  # nested: the same memo
            assert utils.fill_tma_descriptor(*args) is first
        other = utils.fill_tma_descriptor(8192, *args[1:])  # another address
        shape = utils.fill_tma_descriptor(*args[:5], [999, 512], *args[6:])  # another shape
    assert calls == [4096, 8192, 4096] and other[1] == 8192 and shape[3] == (999, 512)
    assert utils.fill_tma_descriptor is fill
    with tma_maps.cached_tma_maps(utils, enabled=False):
        assert utils.fill_tma_descriptor is fill
    with pytest.raises(RuntimeError), tma_maps.cached_tma_maps(utils):
        raise RuntimeError
    assert utils.fill_tma_descriptor is fill
    with tma_maps.cached_tma_maps(utils):  # LRU: the oldest of CAPACITY + 1 goes
        for ptr in range(tma_maps.CAPACITY + 1):
            utils.fill_tma_descriptor(16 * ptr + 16, *args[1:])
        n = len(calls)
        utils.fill_tma_descriptor(16, *args[1:])
        assert len(calls) == n + 1
    tma_maps.clear()


def test_gluon_prefill_rejects_bad_input():
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    dev = "cuda" if HOPPER else "cpu"
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16, device=dev)
    kv = torch.zeros(8, 2, 128, dtype=torch.bfloat16, device=dev)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=dev)
    cases = [
        ((q.float(), kv, kv, cu, 8), "bfloat16 or float16"),
        ((q, kv.half(), kv, cu, 8), "dtypes differ"),
        ((q[..., :64].contiguous(), kv, kv, cu, 8), "128"),
        ((q, kv[:4], kv[:4], cu, 8), "total_tokens"),
        ((q, kv, torch.zeros(8, 1, 128, dtype=torch.bfloat16, device=dev), cu, 8), "differ"),
        ((q[:, :3].contiguous(), kv, kv, cu, 8), "multiple of num_kv_heads"),
        ((q.transpose(0, 1).contiguous().transpose(0, 1), kv, kv, cu, 8), "contiguous"),
        ((q, kv, kv, cu.long(), 8), "int32"),
        ((torch.zeros(8 * 4 * 128 + 1, dtype=torch.bfloat16, device=dev)[1:].view(8, 4, 128), kv, kv, cu, 8),
         "aligned"),
        ((q, kv, kv, cu, 0), "max_seqlen"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            flash_prefill_gluon(*args)
    with pytest.raises(ValueError, match="sm_scale"):
        flash_prefill_gluon(q, kv, kv, cu, 8, sm_scale=0.0)
    with pytest.raises(ValueError, match="out"):
        flash_prefill_gluon(q, kv, kv, cu, 8, out=torch.empty_like(q[:4]))
    with pytest.raises(ValueError, match="schedule"):
        flash_prefill_gluon(q, kv, kv, cu, 8, schedule="greedy")
    with pytest.raises(ValueError, match="q_buffers"):
        flash_prefill_gluon(q, kv, kv, cu, 8, num_stages=3, q_buffers=2)
    if HOPPER:
        with pytest.raises(ValueError, match="head_group"):
            flash_prefill_gluon(q, kv, kv, cu, 8, head_group=5)  # 4 heads x 1 sequence
    if not HOPPER:
        with pytest.raises(ValueError, match="sm_90"):
            flash_prefill_gluon(q, kv, kv, cu, 8)


# --------------------------------------------------------------------------- GPU

LENGTHS = {
    "one": [1],
    "tile_edges": [127, 128, 129, 255, 256, 257],
    "ragged": [1, 200, 1000, 64, 513, 2],
    "long": [2048, 1500],
}


def _ragged(lens, hq, hkv, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, hq, 128, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(total, hkv, 128, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(total, hkv, 128, generator=g, device="cuda", dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _close(out, ref, tol=1.6e-2):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (a row left unwritten?)"
    err = (out.float() - ref.float()).abs().max().item()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= 8 * tol and rel <= tol, f"max abs {err:.2e}, rel {rel:.2e}"


STATIC = {"grid": dict(persistent=False), "static": dict(schedule="static"),
          "snake": dict(schedule="snake")}


def _check_against_ref(lens, causal, hq, hkv, opts, seed=0):
    """One launch with opts (out starts NaN, lse asked for) against flash_attn_varlen_ref:
    out within flash_prefill's bf16 tolerance, lse within 2e-3. Returns out."""
    from flashpage.kernels.flash_prefill import flash_attn_varlen_ref
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    q, k, v, cu = _ragged(lens, hq, hkv, seed=seed)
    out = torch.full_like(q, float("nan"))
    res, lse = flash_prefill_gluon(q, k, v, cu, max(lens), causal=causal, return_lse=True, out=out,
                                   **opts)
    torch.cuda.synchronize()
    ref, ref_lse = flash_attn_varlen_ref(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                         return_lse=True)
    _close(res, ref)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)
    return res


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("sched", list(STATIC), ids=list(STATIC))
def test_gluon_prefill_gpu(lens, causal, hq, hkv, sched):
    """bf16 against flash_attn_varlen_ref (fp32) within flash_prefill's bf16 tolerance;
    out starts NaN, so a row left unwritten fails; the lse within 2e-3. One program per work
    tile and the static persistent schedules (before the dynamic one's tests below: a bug in
    its counter or its tile posting would hang, and these would not have run)."""
    _check_against_ref(lens, causal, hq, hkv, STATIC[sched])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
def test_gluon_prefill_dynamic_gpu(lens, causal, hq, hkv):
    """The default (persistent, dynamic schedule) as above, launched twice: the counter is
    back at zero after each launch (the second computes the same, bit for bit)."""
    from flashpage.kernels import flash_prefill_gluon as fg

    first = _check_against_ref(lens, causal, hq, hkv, {})
    again = _check_against_ref(lens, causal, hq, hkv, {})
    assert torch.equal(first, again)
    assert fg._SCHED_BUFFERS[first.device, True][:2].tolist() == [0, 0]


OPTIONS = {
    "no_pingpong": dict(pingpong=False),
    "no_overlap": dict(pv_overlap=False),
    "run72": dict(schedule="static", pv_overlap=False, head_group=32, q_buffers=1),  # run 72's
    "q1": dict(q_buffers=1),
    "grid_q1": dict(persistent=False, q_buffers=1),
    "dynamic_memset": dict(schedule="dynamic_memset"),
    "hg1": dict(head_group=1),
    "hg3": dict(head_group=3),  # not a divisor of 8 heads x 4 sequences: a short last chunk
    "hg_all": dict(head_group=32),
    "m_fastest": dict(m_fastest=True),
    "stages3": dict(num_stages=3),
    "snake_hg1": dict(schedule="snake", head_group=1),
    "grid_hg1": dict(persistent=False, head_group=1),
    "grid_no_overlap": dict(persistent=False, pv_overlap=False),
    "scale": dict(sm_scale=0.05),
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("opts", list(OPTIONS.values()), ids=list(OPTIONS))
def test_gluon_prefill_options_gpu(opts):
    """Each launcher knob (causal; the matrices above cover full attention per schedule)."""
    from flashpage.kernels.flash_prefill import flash_attn_varlen_ref
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    lens = [700, 1, 129, 1024]
    q, k, v, cu = _ragged(lens, 8, 2, seed=1)
    # out starts NaN: a row left unwritten fails (an empty out may hold the last test's rows)
    out = flash_prefill_gluon(q, k, v, cu, max(lens), causal=True,
                              out=torch.full_like(q, float("nan")), **opts)
    torch.cuda.synchronize()
    ref = flash_attn_varlen_ref(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                sm_scale=opts.get("sm_scale"))
    _close(out, ref)


@pytest.mark.gpu
@hopper
def test_gluon_prefill_dynamic_after_memset_gpu():
    """dynamic_memset, then dynamic, then dynamic_memset again on one device, each right with
    out starting NaN (gpu_run1: one counter for both left the dynamic launch after a
    dynamic_memset one starting at the work size, skipping every tile past the programs'
    first), and the dynamic counter back at zero."""
    from flashpage.kernels import flash_prefill_gluon as fg
    from flashpage.kernels.flash_prefill import flash_attn_varlen_ref

    lens = [700, 1, 129, 1024]
    q, k, v, cu = _ragged(lens, 8, 2, seed=1)
    ref = flash_attn_varlen_ref(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for schedule in ("dynamic_memset", "dynamic", "dynamic_memset", "dynamic"):
        out = fg.flash_prefill_gluon(q, k, v, cu, max(lens), schedule=schedule,
                                     out=torch.full_like(q, float("nan")))
        torch.cuda.synchronize()
        _close(out, ref)
    assert fg._SCHED_BUFFERS[q.device, True][:2].tolist() == [0, 0]


@pytest.mark.gpu
@hopper
def test_gluon_prefill_tma_map_cache_gpu():
    """cache_descriptors (the default) against off: bit for bit the same, contiguous and
    paged; a second call with the same tensors encodes nothing, new tensors (other
    addresses) get their own maps (right answers after the inputs move)."""
    from flashpage.kernels import tma_maps
    from flashpage.kernels.flash_prefill import flash_attn_varlen_ref, paged_prefill_ref
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon, paged_prefill_gluon

    lens = [700, 1, 129, 1024]
    q, k, v, cu = _ragged(lens, 8, 2, seed=1)
    ref = flash_attn_varlen_ref(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    off = flash_prefill_gluon(q, k, v, cu, max(lens), cache_descriptors=False)
    on = flash_prefill_gluon(q, k, v, cu, max(lens))
    n = tma_maps.fill_calls
    again = flash_prefill_gluon(q, k, v, cu, max(lens))
    torch.cuda.synchronize()
    assert tma_maps.fill_calls == n, "encoded again for the same tensors"
    assert torch.equal(on, off) and torch.equal(again, off)
    _close(on, ref)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()  # other addresses
    _close(flash_prefill_gluon(q2, k2, v2, cu, max(lens)), ref)
    assert tma_maps.fill_calls > n
    args = _paged_case([300, 5], [100, 2000], 8, 2, 16, seed=7)
    pref = paged_prefill_ref(*args)
    p_off = paged_prefill_gluon(*args, cache_descriptors=False)
    p_on = paged_prefill_gluon(*args)
    torch.cuda.synchronize()
    assert torch.equal(p_on, p_off)
    _close(p_on, pref)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("schedule", ["dynamic", "dynamic_memset"])
def test_gluon_prefill_cuda_graph_gpu(schedule):
    """Captured once, replayed 3 times on new inputs: each replay right (the dynamic
    schedule's counter zeroed by the kernel itself, or by the memset captured with it), and
    20 launches back to back agree bit for bit."""
    from flashpage.kernels.flash_prefill import flash_attn_varlen_ref
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    lens = [1500, 300, 2048]
    q, k, v, cu = _ragged(lens, 16, 4, seed=3)
    first = flash_prefill_gluon(q, k, v, cu, max(lens), schedule=schedule)  # compile, buffers
    for _ in range(20):
        assert torch.equal(flash_prefill_gluon(q, k, v, cu, max(lens), schedule=schedule), first)
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_prefill_gluon(q, k, v, cu, max(lens), schedule=schedule, out=out)
    for seed in (4, 5, 6):
        q2, k2, v2, _ = _ragged(lens, 16, 4, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _close(out, flash_attn_varlen_ref(q, k, v, cu, cu, max(lens), max(lens), causal=True))


@pytest.mark.gpu
@hopper
def test_gluon_prefill_fp16_and_triton_agree():
    """fp16 input, and the same answer as the Triton prefill (flash_attn_varlen)."""
    from flashpage.kernels.flash_prefill import flash_attn_varlen, flash_attn_varlen_ref
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    lens = [333, 1024, 77]
    q, k, v, cu = _ragged(lens, 8, 8, dtype=torch.float16, seed=2)
    out = flash_prefill_gluon(q, k, v, cu, max(lens))
    ref = flash_attn_varlen_ref(q, k, v, cu, cu, max(lens), max(lens))
    tri = flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens))
    torch.cuda.synchronize()
    _close(out, ref, tol=2e-3)
    _close(out, tri, tol=4e-3)


# --------------------------------------------------------------------------- paged (GPU)
# paged_prefill_gluon against flash_prefill.paged_prefill_ref: K/V scattered into a shuffled
# block pool whose unowned slots hold NaN (spare blocks, the tails of last blocks) and whose
# table entries past each context point at NaN blocks; the static schedules first, as above.


def _paged_case(q_lens, prefixes, hq, hkv, block_size, dtype=torch.bfloat16, seed=0,
                q_stride_heads=None, dev="cuda"):
    """(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_q, max_k): the
    sequences' contexts (prefix + new tokens) scattered over a shuffled pool of blocks;
    q_stride_heads: q as the first Hq heads of a wider [total, q_stride_heads, 128] tensor
    (the engine's q may be a view of a fused projection)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    k_lens = [lq + p for lq, p in zip(q_lens, prefixes, strict=True)]
    total_q = sum(q_lens)
    if q_stride_heads:
        q = torch.randn(total_q, q_stride_heads, 128, generator=g, device=dev, dtype=dtype)[:, :hq]
    else:
        q = torch.randn(total_q, hq, 128, generator=g, device=dev, dtype=dtype)
    nblk = [-(-n // block_size) for n in k_lens]
    nan_blocks = 3
    pool = sum(nblk) + nan_blocks
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(seed)).tolist()
    nan_ids, perm = perm[:nan_blocks], perm[nan_blocks:]
    width = max(nblk) + 2
    tables = torch.tensor(nan_ids[:1], dtype=torch.int32).repeat(len(q_lens), width)  # NaN past the context
    kc = torch.full((pool, block_size, hkv, 128), float("nan"), dtype=dtype, device=dev)
    vc = torch.full_like(kc, float("nan"))
    for b, n in enumerate(k_lens):
        ids, perm = perm[:nblk[b]], perm[nblk[b]:]
        tables[b, :nblk[b]] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n, device=dev)
        blk = torch.tensor(ids, dtype=torch.long, device=dev)[pos // block_size]
        kc[blk, pos % block_size] = torch.randn(n, hkv, 128, generator=g, device=dev, dtype=dtype)
        vc[blk, pos % block_size] = torch.randn(n, hkv, 128, generator=g, device=dev, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(k_lens, dtype=torch.int32, device=dev)
    return q, kc, vc, tables.to(dev), cu_q, seq_lens, max(q_lens), max(k_lens)


def _check_paged(q_lens, prefixes, hq, hkv, block_size, opts, causal=True, seed=0, **case):
    """paged_prefill_gluon (out starts NaN, lse asked for) against paged_prefill_ref: out
    within the bf16 tolerance, finite (no NaN slot reached it), lse within 2e-3."""
    from flashpage.kernels.flash_prefill import paged_prefill_ref
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    args = _paged_case(q_lens, prefixes, hq, hkv, block_size, seed=seed, **case)
    q = args[0]
    out = torch.full((q.shape[0], hq, 128), float("nan"), dtype=q.dtype, device="cuda")
    res, lse = paged_prefill_gluon(*args, causal=causal, return_lse=True, out=out, **opts)
    torch.cuda.synchronize()
    ref, ref_lse = paged_prefill_ref(*args, causal=causal, return_lse=True,
                                     sm_scale=opts.get("sm_scale"))
    assert res is out
    _close(res, ref)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)
    return res, args


PAGED_LENGTHS = {  # name -> (query counts, cached prefixes)
    "q1_prefix": ([1, 1, 1], [0, 15, 3000]),  # single-token chunks (decode-like), one empty prefix
    "ragged": ([1, 200, 1000, 64, 513, 2], [0, 17, 129, 4000, 0, 255]),
    "tile_edges": ([127, 128, 129, 256], [128, 1, 127, 1024]),  # prefix and q at tile edges
    "long": ([2048, 1500], [3000, 0]),
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(PAGED_LENGTHS.values()), ids=list(PAGED_LENGTHS))
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("sched", ["grid", "static"])
def test_paged_gluon_static_gpu(lens, block_size, hq, hkv, sched):
    """Causal paged prefill, one program per work tile and the static persistent schedule
    (before the dynamic one below: a hang there leaves these run)."""
    _check_paged(*lens, hq, hkv, block_size, STATIC[sched])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(PAGED_LENGTHS.values()), ids=list(PAGED_LENGTHS))
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
def test_paged_gluon_gpu(lens, block_size, hq, hkv):
    """The default (persistent, dynamic schedule), causal, twice: the same output bit for
    bit (the counter back at zero)."""
    from flashpage.kernels import flash_prefill_gluon as fg

    first, _ = _check_paged(*lens, hq, hkv, block_size, {})
    again, _ = _check_paged(*lens, hq, hkv, block_size, {})
    assert torch.equal(first, again)
    assert fg._SCHED_BUFFERS[first.device, True][:2].tolist() == [0, 0]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("lens", [PAGED_LENGTHS["ragged"], PAGED_LENGTHS["tile_edges"]],
                         ids=["ragged", "tile_edges"])
def test_paged_gluon_full_gpu(block_size, lens):
    """Full (non-causal) attention over the whole context: every work tile reads the last,
    partial key tile (its NaN tail masked and zeroed)."""
    _check_paged(*lens, 8, 2, block_size, {}, causal=False)


PAGED_OPTIONS = {
    "no_pingpong": dict(pingpong=False),
    "no_overlap": dict(pv_overlap=False),
    "q1": dict(q_buffers=1),
    "q2": dict(q_buffers=2),
    "stages3": dict(num_stages=3),
    "dynamic_memset": dict(schedule="dynamic_memset"),
    "snake_hg1": dict(schedule="snake", head_group=1),
    "scale": dict(sm_scale=0.05),
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("opts", list(PAGED_OPTIONS.values()), ids=list(PAGED_OPTIONS))
def test_paged_gluon_options_gpu(opts):
    _check_paged([700, 1, 129, 1024], [300, 5000, 0, 77], 8, 2, 16, opts, seed=1)


@pytest.mark.gpu
@hopper
def test_paged_gluon_dynamic_after_memset_gpu():
    """options[scale]'s case (gpu_run1's NaN: it ran right after dynamic_memset) with the
    schedules alternating, both scales, out starting NaN each time."""
    for schedule in ("dynamic_memset", "dynamic", "dynamic_memset", "dynamic"):
        for scale in (None, 0.05):
            _check_paged([700, 1, 129, 1024], [300, 5000, 0, 77], 8, 2, 16,
                         dict(schedule=schedule, sm_scale=scale), seed=1)


@pytest.mark.gpu
@hopper
def test_paged_gluon_strided_q_fp16_and_triton_agree():
    """q a view of a wider tensor (rows 24 heads apart: the engine's q may be a slice of a
    fused projection), fp16; the same answer as the Triton paged_prefill."""
    from flashpage.kernels.flash_prefill import paged_prefill, paged_prefill_ref
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    args = _paged_case([333, 1024, 77, 1], [100, 0, 2000, 64], 16, 4, 16, dtype=torch.float16,
                       seed=2, q_stride_heads=24)
    assert not args[0].is_contiguous()
    out = paged_prefill_gluon(*args)
    ref = paged_prefill_ref(*args)
    tri = paged_prefill(*args)
    torch.cuda.synchronize()
    _close(out, ref, tol=2e-3)
    _close(out, tri, tol=4e-3)


@pytest.mark.gpu
@hopper
def test_paged_gluon_one_compile_for_every_slice_offset():
    """The engine passes seq_lens[nd:] and block_tables[nd:] (alignment following the number
    of decodes nd): one compile serves every offset, the same output at each, and other
    steps' shapes."""
    from flashpage.kernels import flash_prefill_gluon as fg
    from flashpage.kernels.flash_prefill import paged_prefill_ref

    q, kc, vc, tables, cu_q, seq_lens, mq, mk = _paged_case([5, 9, 3, 17, 6, 11],
                                                            [0, 7, 0, 40, 2, 0], 8, 2, 16, seed=3)
    outs, sizes = [], []
    n = seq_lens.numel()
    for nd in range(4):
        lens_view = torch.empty(n + nd, dtype=torch.int32, device="cuda")[nd:]
        lens_view.copy_(seq_lens)
        tab_view = torch.empty(n + nd, tables.shape[1], dtype=torch.int32, device="cuda")[nd:]
        tab_view.copy_(tables)
        outs.append(fg.paged_prefill_gluon(q, kc, vc, tab_view, cu_q, lens_view, mq, mk))
        cache = fg._flash_prefill_gluon_kernel.device_caches[torch.cuda.current_device()][0]
        sizes.append(len(cache))
    assert sizes[-1] == sizes[0], f"compiled again for another slice offset: {sizes}"
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    # other steps' shapes (one query tile or several, 1 or 3 sequences: num_m, num_hb,
    # head_group and the lse stride vary) reuse that compile too
    for q_lens, prefixes in (([1], [33]), ([300, 5, 17], [0, 900, 16])):
        case = _paged_case(q_lens, prefixes, 8, 2, 16, seed=5)
        _close(fg.paged_prefill_gluon(*case), paged_prefill_ref(*case))
        assert len(cache) == sizes[0], f"compiled again for {q_lens}: {len(cache)} kernels"


@pytest.mark.gpu
@hopper
def test_paged_prefill_dispatches_to_gluon(monkeypatch):
    """FLASHPAGE_PREFILL_GLUON=1: flash_prefill.paged_prefill (the triton backend's prefill)
    runs the Gluon kernel where gluon_prefill_unsupported finds nothing (counted), the
    Triton kernel otherwise (a window); both right."""
    from flashpage.kernels import flash_prefill_gluon as fg
    from flashpage.kernels.flash_prefill import paged_prefill, paged_prefill_ref

    calls = []
    real = fg.plan_paged
    monkeypatch.setattr(fg, "plan_paged", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "1")
    args = _paged_case([300, 1, 64], [1000, 77, 0], 8, 2, 16, seed=4)
    out = torch.empty(args[0].shape, dtype=args[0].dtype, device="cuda")
    res = paged_prefill(*args, out=out)
    assert res is out and calls == [1]
    _close(res, paged_prefill_ref(*args))
    windowed = paged_prefill(*args, window_size=256)
    assert calls == [1]  # the window: Triton
    _close(windowed, paged_prefill_ref(*args, window_size=256))
    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "0")
    paged_prefill(*args)
    assert calls == [1]


# --------------------------------------------------------------------------- paged (CPU)


def test_paged_gluon_rejects_bad_input():
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    dev = "cuda" if HOPPER else "cpu"
    bf = torch.bfloat16
    q = torch.zeros(8, 4, 128, dtype=bf, device=dev)
    kc = torch.zeros(6, 16, 2, 128, dtype=bf, device=dev)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=dev)
    lens = torch.tensor([20], dtype=torch.int32, device=dev)
    cases = [
        ((q.float(), kc, kc, tables, cu, lens, 8, 20), "bfloat16 or float16"),
        ((q, kc.half(), kc.half(), tables, cu, lens, 8, 20), "dtypes differ"),
        ((q, kc.to(torch.float8_e4m3fn), kc.to(torch.float8_e4m3fn), tables, cu, lens, 8, 20), "fp8"),
        ((q[..., :64].contiguous(), kc, kc, tables, cu, lens, 8, 20), "128"),
        ((q, kc[..., :64].contiguous(), kc[..., :64].contiguous(), tables, cu, lens, 8, 20), "key_cache"),
        ((q, kc, kc[:3], tables, cu, lens, 8, 20), "differ"),
        ((q, kc[:, :8].contiguous(), kc[:, :8].contiguous(), tables, cu, lens, 8, 20), "power of two >= 16"),
        ((q, torch.zeros(6, 24, 2, 128, dtype=bf, device=dev), torch.zeros(6, 24, 2, 128, dtype=bf, device=dev),
          tables, cu, lens, 8, 20), "power of two"),
        ((q[:, :3], kc, kc, tables, cu, lens, 8, 20), "multiple of num_kv_heads"),
        ((q, kc.transpose(1, 2).contiguous().transpose(1, 2), kc, tables, cu, lens, 8, 20), "contiguous"),
        ((q, kc, kc, tables, cu.long(), lens, 8, 20), "cu_seqlens_q"),
        ((q, kc, kc, tables, cu, lens.long(), 8, 20), "seq_lens"),
        ((q, kc, kc, tables.long(), cu, lens, 8, 20), "block_tables"),
        ((q, kc, kc, tables[:, :1], cu, lens, 8, 20), "fewer than max_seqlen_k"),
        ((q, kc, kc, tables, cu, lens, 0, 20), "max_seqlen_q"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            paged_prefill_gluon(*args)
    with pytest.raises(ValueError, match="sm_scale"):
        paged_prefill_gluon(q, kc, kc, tables, cu, lens, 8, 20, sm_scale=-1.0)
    with pytest.raises(ValueError, match="out"):
        paged_prefill_gluon(q, kc, kc, tables, cu, lens, 8, 20, out=torch.empty_like(q[:4]))
    with pytest.raises(ValueError, match="schedule"):
        paged_prefill_gluon(q, kc, kc, tables, cu, lens, 8, 20, schedule="greedy")
    if not HOPPER:
        with pytest.raises(ValueError, match="sm_90"):
            paged_prefill_gluon(q, kc, kc, tables, cu, lens, 8, 20)


def test_gluon_prefill_unsupported_names_each_reason():
    """One reason per uncovered condition (the engine's switch consults it on any device)."""
    from flashpage.kernels.flash_prefill import gluon_prefill_unsupported

    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    kc = torch.zeros(6, 16, 2, 128, dtype=torch.bfloat16)
    ok = dict(capability=(9, 0))

    def only(reasons, word):
        assert len(reasons) == 1 and word in reasons[0], reasons

    assert gluon_prefill_unsupported(q, kc, kc, None, **ok) == []
    assert gluon_prefill_unsupported(q.half(), kc.half(), kc.half(), None, **ok) == []
    for bs in (32, 64, 128, 256):
        big = torch.zeros(2, bs, 2, 128, dtype=torch.bfloat16)
        assert gluon_prefill_unsupported(q, big, big, None, **ok) == []
    wide = torch.zeros(8, 6, 128, dtype=torch.bfloat16)[:, :4]  # rows 6 heads apart: fine
    assert gluon_prefill_unsupported(wide, kc, kc, None, **ok) == []
    only(gluon_prefill_unsupported(q, kc, kc, None, capability=(8, 0)), "sm_90")
    only(gluon_prefill_unsupported(q, kc, kc, None), "sm_90")  # a CPU tensor
    only(gluon_prefill_unsupported(q.float(), kc.float(), kc.float(), None, **ok), "query")
    fp8 = kc.to(torch.float8_e4m3fn)
    only(gluon_prefill_unsupported(q, fp8, fp8, None, **ok), "no fp8")
    only(gluon_prefill_unsupported(q, kc, kc, 128, **ok), "window")
    small = torch.zeros(6, 8, 2, 128, dtype=torch.bfloat16)
    only(gluon_prefill_unsupported(q, small, small, None, **ok), "block_size")
    odd = torch.zeros(6, 24, 2, 128, dtype=torch.bfloat16)
    only(gluon_prefill_unsupported(q, odd, odd, None, **ok), "block_size")
    k64 = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)
    only(gluon_prefill_unsupported(q[..., :64].contiguous(), k64, k64, None, **ok), "head_dim 128")
    strided = kc.transpose(1, 2).contiguous().transpose(1, 2)
    only(gluon_prefill_unsupported(q, strided, strided, None, **ok), "contiguous caches")
    gapped = torch.zeros(8, 4, 256, dtype=torch.bfloat16)[..., :128]
    only(gluon_prefill_unsupported(gapped, kc, kc, None, **ok), "rows contiguous")


def test_paged_case_builder_cpu():
    """The GPU tests' cache builder (on the CPU): every owned slot holds its key, every
    other slot of the pool and every table entry past a context is NaN, and the reference
    over it is finite."""
    from flashpage.kernels.flash_prefill import paged_prefill_ref

    q, kc, vc, tables, cu_q, seq_lens, mq, mk = _paged_case([3, 1, 20], [17, 0, 40], 4, 2, 16,
                                                            dtype=torch.float32, dev="cpu",
                                                            q_stride_heads=6)
    assert q.shape == (24, 4, 128) and q.stride(0) == 6 * 128
    assert cu_q.tolist() == [0, 3, 4, 24] and seq_lens.tolist() == [20, 1, 60] and (mq, mk) == (20, 60)
    owned = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        blk = tables[b].long()[pos // 16]
        assert not owned[blk, pos % 16].any()  # no slot shared
        owned[blk, pos % 16] = True
        assert torch.isnan(kc[tables[b, -(-n // 16):].long()]).all()  # past the context: NaN blocks
    assert torch.isfinite(kc[owned]).all() and torch.isfinite(vc[owned]).all()
    assert torch.isnan(kc[~owned]).all() and torch.isnan(vc[~owned]).all()
    out = paged_prefill_ref(q, kc, vc, tables, cu_q, seq_lens, mq, mk)
    assert torch.isfinite(out).all()
