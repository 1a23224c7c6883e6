"""The persistent Gluon fp8 paged decode (kernels/paged_decode_gluon.py).

CPU: the kernel compiled for sm_90 (Triton's ptxas and nvdisasm, no GPU) in each variant at 3
and 4 programs an SM: the pages arrive by TMA, nothing spills (but the default variant at 4),
and the tile loop reads K and V from shared memory 16 bytes at a time (no byte loads) and
widens e4m3 to fp16 in registers; its instruction mix is printed. Bad launches raise
ValueError; engine_form and FLASHPAGE_DECODE_GLUON pick the engine's form.
GPU (marked gpu): against paged_decode_ref on the same fp8 cache and against the Triton
kernel, over ragged contexts with NaN in every slot no sequence owns; both variants (default,
keys_m), at 3 and 4 programs an SM and on a few programs (many items each, 2-4 stages), with
CUDA-graph padding rows (seq_len 0), in a CUDA graph, and through paged_decode.
"""

from __future__ import annotations

import pytest
import torch
from sm90 import (  # tests/kernels (on sys.path under pytest)
    ptxas_sm90a,
    ptxas_usage,
    run_compiled,
    tma_mma_loop_mix,
)

GPU = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(GPU, reason="the sm_90 compile without a GPU")


# --------------------------------------------------------------------------- sm_90 compile (CPU)


def compile_sm90(group: int = 4, max_regs: int | None = None, stages: int | None = None,
                 variant: str = "default"):
    """The kernel compiled for sm_90 as an H200 launch compiles it (bf16 q and out; pointers
    and the strides that are multiples of 16 there marked so; 8 KV heads): Triton's
    CompiledKernel. ``max_regs``: the register cap, None for what ``_launch`` passes at
    PROGRAMS_PER_SM (persistent_max_regs); ``stages``: None for STAGES; ``variant``: one of
    VARIANTS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashpage.kernels import paged_decode_gluon as pg

    fn = pg._paged_decode_gluon_persistent_kernel
    consts = {"GROUP": group, "S": stages or pg.STAGES, "HKV": 8, "KEYS_M": variant == "keys_m"}
    max_regs = max_regs or pg.persistent_max_regs(pg.PROGRAMS_PER_SM)
    desc = f"tensordesc<fp8e4nv[{pg.PAGE}, {pg.HEAD_DIM}],{pg._TMA_SMEM.value!r}>"
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({"q_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "sm_scale_log2": "fp32"})
    sig.update({c: "constexpr" for c in consts})
    aligned = ("q_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr", "stride_qb", "stride_qh",
               "stride_ob", "stride_oh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = dict(num_warps=pg.NUM_WARPS, **({"maxnreg": max_regs} if max_regs else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _sm90_report() -> dict:
    """(In a subprocess with the interpreter off.) ptxas -v's registers and spills, the
    shared memory, whether the PTX issues TMA loads, and the tile loop's SASS mix; for each
    variant at 3 programs an SM (its register cap) and at 4 (128). {"skip": why} where Gluon
    cannot compile."""
    import triton

    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as ex:
        return {"skip": f"no Gluon in this Triton: {ex}"}
    from flashpage.kernels import paged_decode_gluon as pg

    out = {}
    for variant in pg.VARIANTS:
        for name, cap in ((variant, None), (f"{variant}_4", pg.persistent_max_regs(4))):
            k = compile_sm90(max_regs=cap, variant=variant)
            log, sass = ptxas_sm90a(k.asm["ptx"])
            out[name] = dict(**ptxas_usage(log), shared=k.metadata.shared, threads=32 * k.metadata.num_warps,
                             tma_ptx="cp.async.bulk.tensor" in k.asm["ptx"], loop=tma_mma_loop_mix(sass))
    return out


@cpu_only
def test_gluon_decode_compiles_for_sm90():
    """The default variant at 3 programs an SM: TMA loads, no spill under its register cap, 3
    programs an SM by registers and 4 by shared memory (the merge goes through the ring: no 32
    KB reduction scratch beside it); per warp per 64-key tile 8 TMA boxes (4 K, 4 V page
    pieces), K and V read from shared memory in 16-byte loads only (8: 4 of K, 4 of V), 32 HMMA,
    64 e4m3 -> fp16 widenings, one mbarrier wait, Triton's 10 bar.syncs, no integer division
    (the KV head count is a constexpr); then keys_m against it. Prints registers,
    shared memory, programs per SM and the loops' mixes."""
    from flashpage.kernels import paged_decode_gluon as pg

    rep = run_compiled("test_paged_decode_gluon", "_sm90_report")
    if "skip" in rep:
        pytest.skip(rep["skip"])
    for name, r in rep.items():
        per_sm = min(65536 // (r["regs"] * r["threads"]), (227 * 1024) // r["shared"])
        print(f"{name}: {r['regs']} registers x {r['threads']} threads, {r['spill_bytes']} bytes spilled, "
              f"{r['shared']} B shared, {per_sm} programs per SM")
        print(f"  loop: {r['loop']}")
    pe = rep["default"]
    assert pe["tma_ptx"] and pe["spill_bytes"] == 0
    assert pe["regs"] <= pg.persistent_max_regs(pg.PROGRAMS_PER_SM) and 65536 // (pe["regs"] * 128) >= 3
    assert 4 * (pe["shared"] + 1024) <= 228 * 1024
    pl = pe["loop"]
    assert pl["UTMALDG.2D"] == 8  # 4 K + 4 V page pieces per tile
    assert pl["LDS.128"] == 8 and not any(o.startswith(("LDS", "STS")) and o != "LDS.128" for o in pl)
    assert pl["HMMA.16816.F32"] == 32
    assert pl["F2FP.F16.E4M3.UNPACK_B"] == 64
    assert pl["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1  # one mbarrier wait per tile
    assert pl["BAR.SYNC.DEFER_BLOCKING"] == 10  # Triton's bar.sync between TMA issues, and the release
    assert not any(o in pl for o in ("MUFU.RCP", "I2F.RP", "IABS"))  # no runtime division
    assert pl["total"] <= 610, pl["total"]  # Triton 3.6: 590

    # keys_m (GQA group padded to 8): the same TMA, the same 16-byte loads of K and V, the same
    # widenings and one wait a tile, but both dots transposed: 8 HMMA a piece instead of 16, a
    # [128, 8] accumulator (half the rescaling FMULs), the softmax on 4 scores a thread instead of
    # 8, q scaled in the mma's operand layout (no operand copies before each QK HMMA). At least 100
    # instructions a warp shorter than the default (Triton 3.6: 455 against 590), and under 128
    # registers (4 programs an SM) without a spill.
    for name in ("keys_m", "keys_m_4"):
        r = rep[name]
        vl = r["loop"]
        assert r["tma_ptx"] and r["spill_bytes"] == 0, name
        for op in ("UTMALDG.2D", "LDS.128", "F2FP.F16.E4M3.UNPACK_B", "SYNCS.PHASECHK.TRANS64.TRYWAIT",
                   "BAR.SYNC.DEFER_BLOCKING"):
            assert vl[op] == pl[op], (name, op)
        assert not any(o.startswith(("LDS", "STS")) and o != "LDS.128" for o in vl), name
        assert vl["HMMA.16816.F32"] == 16, name
        assert vl["FMUL"] <= pl["FMUL"] // 2, name  # the rescale of a [128, 8] accumulator
        assert vl["MUFU.EX2"] <= 6, name  # 4 scores + the alphas
        assert vl.get("SHFL.IDX", 0) <= 2, name  # P's transpose
        assert vl["total"] <= pl["total"] - 100, (name, vl["total"], pl["total"])
    assert rep["keys_m"]["regs"] <= pg.persistent_max_regs(pg.PROGRAMS_PER_SM)
    assert rep["keys_m_4"]["regs"] <= pg.persistent_max_regs(4)


def test_gluon_decode_variant_views():
    """keys_m's shared-memory views and load layouts are the default variant's with the
    last two coordinates swapped (V^T of _V_VIEW, K of _K_VIEW^T: the same bytes, the same
    head-dim permutation), and the load layouts own, thread by thread, what the mma operand
    layouts need (so that the conversion only renames registers)."""
    from flashpage.kernels import paged_decode_gluon as pg

    def swap(bases):
        return [[b[0], b[2], b[1]] for b in bases]

    assert pg._VT_VIEW.value.offset_bases == swap(pg._V_VIEW.value.offset_bases)
    assert pg._KA_VIEW.value.offset_bases == swap(pg._K_VIEW.value.offset_bases)
    assert pg._VT_LOAD.value.reg_bases == swap(pg._V_LOAD.value.reg_bases)
    assert pg._VT_LOAD.value.lane_bases == swap(pg._V_LOAD.value.lane_bases)

    # The mma_v2 A operand ([piece, m, k], k_width 2) of m16n8k16: lane (g, t) holds rows g, g + 8
    # (+ 16 per m-tile) and k 2t, 2t + 1, 2t + 8, 2t + 9; its lanes as bases: t -> k bits 1-2,
    # g -> m bits 0-2. The load layouts must put the same coordinates on the lanes (and on the
    # warps: the piece), the rest in registers.
    a_lanes = [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    k_regs = {(0, 0, 1), (0, 0, 8)}  # k bits 0 and 3
    for lay, regs in ((pg._VT_LOAD, k_regs | {(0, 8, 0), (0, 16, 0), (0, 32, 0), (0, 64, 0)}),  # 8 m-tiles
                      (pg._KA_LOAD, k_regs | {(0, 8, 0), (0, 0, 16), (0, 0, 32), (0, 0, 64)})):  # 8 k-steps
        v = lay.value
        assert v.lane_bases == a_lanes and v.warp_bases == [[1, 0, 0], [2, 0, 0]]
        assert {tuple(b) for b in v.reg_bases} == regs


def test_gluon_decode_rejects_what_it_does_not_cover():
    from flashpage.kernels.paged_decode_gluon import paged_decode_gluon

    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 8, 128).to(torch.float8_e4m3fn)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    from flashpage.kernels.paged_decode_gluon import _launch

    with pytest.raises(ValueError, match="variant must be one of"):
        _launch(q, kc, kc, tables, lens, variant="keys")
    with pytest.raises(ValueError, match="programs_per_sm must be 1-4"):
        _launch(q, kc, kc, tables, lens, programs_per_sm=5)
    with pytest.raises(ValueError, match="stages must be >= 2"):
        _launch(q, kc, kc, tables, lens, stages=1)
    if not GPU:
        with pytest.raises(ValueError, match="sm_90"):
            paged_decode_gluon(q, kc, kc, tables, lens)
        return
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    dev = "cuda"
    q, kc, tables, lens = q.to(dev), kc.to(dev), tables.to(dev), lens.to(dev)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_decode_gluon(q, kc.bfloat16(), kc.bfloat16(), tables, lens)
    with pytest.raises(ValueError, match="128"):
        paged_decode_gluon(q[..., :64], kc[..., :64].contiguous(), kc[..., :64].contiguous(), tables, lens)
    with pytest.raises(ValueError, match="contiguous"):
        kc32 = torch.zeros(4, 32, 8, 128, device=dev).to(torch.float8_e4m3fn)
        paged_decode_gluon(q, kc32, kc32, tables, lens)
    with pytest.raises(ValueError, match="at most 8 query heads"):  # 16 a KV head: a group of 16
        _launch(q, kc[:, :, :2].contiguous(), kc[:, :, :2].contiguous(), tables, lens, variant="keys_m")


def test_engine_form_and_its_switch(monkeypatch):
    """What paged_decode hands the persistent kernel: keys_m at 4 programs an SM (a group of 8
    too); the default variant at 3 for groups over 8, whatever is asked; a variant named by
    FLASHPAGE_DECODE_GLUON; a misspelt or removed one is an error naming the choices."""
    from flashpage import envs
    from flashpage.kernels.paged_decode_gluon import engine_form

    assert engine_form(4) == engine_form(8) == {"variant": "keys_m", "programs_per_sm": 4}
    assert engine_form(16) == engine_form(16, "keys_m") == {"variant": "default", "programs_per_sm": 3}
    assert engine_form(4, "keys_m") == {"variant": "keys_m", "programs_per_sm": 4}
    assert engine_form(4, "default") == {"variant": "default", "programs_per_sm": 3}
    for bad in ("keys", "dims_m", "keys_m2"):
        with pytest.raises(ValueError, match=f"FLASHPAGE_DECODE_GLUON.*'default', 'keys_m'.*'{bad}'"):
            engine_form(4, bad)
    for value, want in (("1", None), ("0", None), ("default", "default")):
        monkeypatch.setenv("FLASHPAGE_DECODE_GLUON", value)
        assert envs.decode_gluon_variant() == want and envs.decode_gluon() == (value != "0")
    monkeypatch.delenv("FLASHPAGE_DECODE_GLUON")
    assert envs.decode_gluon_variant() is None and envs.decode_gluon()


# --------------------------------------------------------------------------- GPU

hopper = pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs an sm_90 GPU")

GLUON_CASES = [
    [1, 17, 64, 200, 1000, 2048],  # ragged: a single key, part pages, a whole tile, long
    [2048, 1000, 200, 64, 17, 1] * 6,  # longest first, 36 sequences (288 programs)
    [65, 63, 128, 129, 191, 192, 193],  # around the 64-key tile boundary
]
GLUON_VARIANTS = {"default": {}, "pps4": {"programs_per_sm": 4},
                  # a few programs, many items each: tiles in flight across item boundaries, items
                  # shorter than the tiles in flight
                  "p5": {"programs": 5}, "p7_s2": {"programs": 7, "stages": 2},
                  "p3_s4": {"programs": 3, "stages": 4},
                  # keys_m (both dots transposed), as compiled, under 128 registers (4 programs an
                  # SM: the engine's form), and on a few programs at 2-4 stages
                  "keys_m": {"variant": "keys_m"}, "keys_m_pps4": {"variant": "keys_m", "programs_per_sm": 4},
                  "keys_m_p5": {"variant": "keys_m", "programs": 5},
                  "keys_m_p7_s2": {"variant": "keys_m", "programs": 7, "stages": 2},
                  "keys_m_p3_s4": {"variant": "keys_m", "programs": 3, "stages": 4}}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", GLUON_CASES, ids=["ragged", "longest_first", "tile_edges"])
@pytest.mark.parametrize("variant", list(GLUON_VARIANTS))
def test_paged_decode_gluon_gpu(lens, variant, monkeypatch):
    """Against paged_decode_ref on the same fp8 cache (every other slot NaN: a slot read
    past a context poisons the output) within the bf16 decode tolerance, and against the
    Triton kernel within twice it; every output row written (out starts NaN). The default
    variant at 3 and 4 programs an SM and on 3-7 programs (2-4 stages), and keys_m likewise."""
    from test_fp8_kv import DECODE_TOL, gen, paged_pair, rel_err

    from flashpage.kernels.paged_decode import paged_decode, paged_decode_ref
    from flashpage.kernels.paged_decode_gluon import _launch

    g = gen(sum(lens))
    _, _, kc8, vc8, tables, seq_lens = paged_pair(lens, 8, 128, 16, torch.bfloat16, g)
    q = torch.randn(len(lens), 32, 128, generator=g, device="cuda").bfloat16()
    out = _launch(q, kc8, vc8, tables, seq_lens, out=torch.full_like(q, float("nan")), **GLUON_VARIANTS[variant])
    ref = paged_decode_ref(q, kc8, vc8, tables, seq_lens)
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON", "0")  # the Triton kernel, not this one
    triton_out = paged_decode(q, kc8, vc8, tables, seq_lens)
    assert not out.isnan().any(), "NaN: a slot past a context was read, or a row left unwritten"
    tol = DECODE_TOL[torch.bfloat16]
    for b in range(len(lens)):  # per sequence, so that one bad length shows by itself
        assert rel_err(out[b], ref[b]) < tol, f"sequence {b} (context {lens[b]}): {rel_err(out[b], ref[b]):.2e}"
    assert rel_err(out, triton_out) < 2 * tol


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", ["default", "keys_m"])
def test_paged_decode_gluon_sharp_scores(variant):
    """Queries scaled x 8 (scores with a std of ~11 in log2 units: maxima ~23 on a first
    tile, ~40 over 2048 keys), so that a running max jumps by more than 2^8 in the middle of
    sequences, not only on the first tile: the online rescale under large factors."""
    from test_fp8_kv import DECODE_TOL, gen, paged_pair, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon import _launch

    lens = [2048, 1000, 333, 64, 17, 1] * 6
    g = gen(9)
    _, _, kc8, vc8, tables, seq_lens = paged_pair(lens, 8, 128, 16, torch.bfloat16, g)
    q = (8 * torch.randn(len(lens), 32, 128, generator=g, device="cuda")).bfloat16()
    out = _launch(q, kc8, vc8, tables, seq_lens, out=torch.full_like(q, float("nan")), **GLUON_VARIANTS[variant])
    ref = paged_decode_ref(q, kc8, vc8, tables, seq_lens)
    assert not out.isnan().any()
    assert rel_err(out, ref) < DECODE_TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("variant", ["default", "keys_m"])
def test_paged_decode_gluon_groups(variant, group):
    """GQA groups of 1, 2 and 8 query heads a KV head (keys_m pads the group to 8: all of it
    real at 8) against the reference, out starting NaN (every real row written)."""
    from test_fp8_kv import DECODE_TOL, gen, paged_pair, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon import _launch

    lens = [1000, 1, 64, 129, 2048, 17]
    g = gen(13)
    _, _, kc8, vc8, tables, seq_lens = paged_pair(lens, 4, 128, 16, torch.bfloat16, g)
    q = torch.randn(len(lens), 4 * group, 128, generator=g, device="cuda").bfloat16()
    out = _launch(q, kc8, vc8, tables, seq_lens, out=torch.full_like(q, float("nan")), **GLUON_VARIANTS[variant])
    ref = paged_decode_ref(q, kc8, vc8, tables, seq_lens)
    assert not out.isnan().any()
    for b in range(len(lens)):
        assert rel_err(out[b], ref[b]) < DECODE_TOL[torch.bfloat16], f"sequence {b} (context {lens[b]})"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", ["default", "p5", "p7_s2", "p3_s4", "keys_m", "keys_m_p5", "keys_m_p7_s2",
                                     "keys_m_p3_s4"])
def test_paged_decode_gluon_padding_rows(variant):
    """seq_len 0 rows (CUDA-graph padding) among others, first, last and in runs, their block
    tables garbage: zeros for them (out starts NaN), the others as the reference."""
    from test_fp8_kv import gen, paged_pair

    from flashpage.kernels.paged_decode_gluon import _launch

    g = gen(11)
    _, _, kc8, vc8, tables, seq_lens = paged_pair(PADDING_LENS, 8, 128, 16, torch.bfloat16, g)
    q = torch.randn(len(PADDING_LENS), 32, 128, generator=g, device="cuda").bfloat16()
    check_padding_rows(lambda *a, out: _launch(*a, out=out, **GLUON_VARIANTS[variant]),
                       q, kc8, vc8, tables, seq_lens)


PADDING_LENS = [0, 2048, 17, 0, 0, 1, 64, 0, 1000, 65, 0, 0, 0, 129, 1, 0]


def check_padding_rows(launch, q, kc, vc, tables, seq_lens):
    """``launch(q, kc, vc, tables, seq_lens, out=...)`` over PADDING_LENS (its seq_len 0 rows'
    tables garbage): zeros there (out starts NaN), the others as paged_decode_ref; then
    batches of padding only, of one padding row, of one 1-key and of one 17-key sequence."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref

    lens = PADDING_LENS
    pad = [b for b, n in enumerate(lens) if n == 0]
    tables[pad] = 2**30  # never read
    out = launch(q, kc, vc, tables, seq_lens, out=torch.full_like(q, float("nan")))
    torch.cuda.synchronize()
    assert (out[pad] == 0).all(), "a padding row not zero"
    tables[pad] = 0
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    for b, n in enumerate(lens):
        if n:
            assert rel_err(out[b], ref[b]) < DECODE_TOL[torch.bfloat16], f"sequence {b} (context {n})"
    for rows in (pad, [0], [5], [2]):
        q2, tables2, lens2 = q[rows], tables[rows], seq_lens[rows]
        out2 = launch(q2, kc, vc, tables2, lens2, out=torch.full_like(q2, float("nan")))
        torch.cuda.synchronize()
        if lens2.any():
            assert rel_err(out2, paged_decode_ref(q2, kc, vc, tables2, lens2)) < DECODE_TOL[torch.bfloat16]
        else:
            assert (out2 == 0).all()


GRAPH_VARIANTS = {"default": {}, "keys_m": {"variant": "keys_m"},
                  "keys_m_pps4": {"variant": "keys_m", "programs_per_sm": 4}}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", list(GRAPH_VARIANTS))
def test_paged_decode_gluon_cuda_graph(variant):
    """Captured once, replayed with new queries and lengths (descriptors are kernel
    parameters: the caches must stay where they were), then again with a padding row
    (seq_len 0: zeros)."""
    from test_fp8_kv import gen, paged_pair

    from flashpage.kernels.paged_decode_gluon import _launch

    g = gen(5)
    _, _, kc, vc, tables, lens = paged_pair([900, 20, 2000], 8, 128, 16, torch.bfloat16, g)
    q = torch.randn(3, 32, 128, generator=g, device="cuda").bfloat16()
    check_graph_replay(lambda *a, out: _launch(*a, out=out, **GRAPH_VARIANTS[variant]), q, kc, vc, tables, lens, g)


def check_graph_replay(launch, q, kc, vc, tables, lens, g):
    """``launch(q, kc, vc, tables, lens, out=...)`` over contexts [900, 20, 2000], captured once
    in a CUDA graph, replayed with new queries (from ``g``) and lengths, then again with a
    padding row (seq_len 0: zeros); each replay against paged_decode_ref."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref

    out = torch.empty_like(q)
    launch(q, kc, vc, tables, lens, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(q, kc, vc, tables, lens, out=out)
    q.copy_(torch.randn(3, 32, 128, generator=g, device="cuda").to(q.dtype))
    lens.copy_(torch.tensor([5, 20, 1999], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, paged_decode_ref(q, kc, vc, tables, lens)) < DECODE_TOL[torch.bfloat16]
    lens.copy_(torch.tensor([899, 0, 64], dtype=torch.int32))  # within what each holds
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert (out[1] == 0).all()
    assert rel_err(out, paged_decode_ref(q, kc, vc, tables, lens)) < DECODE_TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("choice", ["1", "default", "keys_m"])
@pytest.mark.parametrize("group", [4, 16])
def test_paged_decode_routes_to_the_engine_form(choice, group, monkeypatch):
    """paged_decode itself (the engine's call) at an unsplit fp8 batch, under each
    FLASHPAGE_DECODE_GLUON choice: against the reference, every row written, and against
    FLASHPAGE_DECODE_GLUON=0 (Triton); a group of 16 runs the default variant whatever the choice."""
    from test_fp8_kv import DECODE_TOL, gen, paged_pair, rel_err

    from flashpage.kernels.paged_decode import (
        _num_sms,
        choose_num_splits,
        default_config,
        paged_decode,
        paged_decode_ref,
    )

    hkv = 32 // group
    lens = [2048, 1000, 200, 64, 17, 1] * (8 if hkv == 8 else 20)  # unsplit: 48 x 8 / 120 x 2 programs
    g = gen(sum(lens))
    _, _, kc8, vc8, tables, seq_lens = paged_pair(lens, hkv, 128, 16, torch.bfloat16, g)
    cfg = default_config(kc8.device, 128, len(lens) * hkv, fp8=True)
    assert cfg.gluon and choose_num_splits(len(lens), hkv, tables.shape[1] * 16, _num_sms(kc8.device),
                                           programs_per_sm=cfg.programs_per_sm) == 1
    q = torch.randn(len(lens), 32, 128, generator=g, device="cuda").bfloat16()
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON", choice)
    out = paged_decode(q, kc8, vc8, tables, seq_lens, out=torch.full_like(q, float("nan")))
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON", "0")
    triton_out = paged_decode(q, kc8, vc8, tables, seq_lens)
    ref = paged_decode_ref(q, kc8, vc8, tables, seq_lens)
    assert not out.isnan().any()
    tol = DECODE_TOL[torch.bfloat16]
    assert rel_err(out, ref) < tol and rel_err(out, triton_out) < 2 * tol
