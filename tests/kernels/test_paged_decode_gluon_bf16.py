"""The persistent Gluon paged decode over a 16-bit cache (kernels/paged_decode_gluon_bf16.py).

CPU: the kernel compiled for sm_90 (Triton's ptxas and nvdisasm, no GPU) in bf16 and fp16, at
3 programs an SM x 2 stages (168-register cap), 2 x 3 and 1 x 6, GQA groups 1 / 4 / 8: the
pages arrive by 3-D TMA boxes (8 a 64-key tile), nothing spills, the tile loop reads K by
``ldmatrix`` and V by ``ldmatrix.trans`` only (8 each a warp) and has 16 HMMA, one mbarrier
wait and no widening; shared memory lets the programs share an SM. The shared-memory views
undo TMA's 128-byte swizzle (checked element by element). Bad input raises ValueError naming
what is wrong; paged_decode's switch (FLASHPAGE_DECODE_GLUON_BF16) is on by default.
GPU (marked gpu, Hopper): against paged_decode_ref on the same 16-bit cache (every slot no
sequence owns NaN) in bf16 and fp16 over ragged contexts, on few programs with many items each
(tiles in flight across items), padding rows, sharp scores, GQA groups 1 / 4 / 8, a CUDA-graph
replay, and paged_decode's routing under the switch.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from sm90 import (
    ptxas_sm90a,
    ptxas_usage,
    run_compiled,
    tma_mma_loop_mix,
)

GPU = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(GPU, reason="the sm_90 compile without a GPU")
hopper = pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")


# --------------------------------------------------------------------------- sm_90 compile (CPU)


def compile_sm90(group: int = 4, stages: int = 2, dtype: str = "bf16", programs_per_sm: int = 3,
                 first_together: bool = False):
    """The kernel compiled for sm_90 as an H200 launch compiles it (q, caches and out in ``dtype``;
    pointers and the strides that are multiples of 16 there marked so; 8 KV heads; the register
    cap ``_launch`` passes for ``programs_per_sm``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashpage.kernels import paged_decode_gluon_bf16 as pg

    fn = pg._paged_decode_gluon16_kernel
    consts = {"GROUP": group, "S": stages, "HKV": 8, "FIRST_TOGETHER": first_together}
    desc = f"tensordesc<{dtype}[2, {pg.PAGE}, {pg.HALF}],{pg._TMA_SMEM.value!r}>"
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({"q_ptr": f"*{dtype}", "k_desc": desc, "v_desc": desc, "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "out_ptr": f"*{dtype}", "sm_scale_log2": "fp32"})
    sig.update({c: "constexpr" for c in consts})
    aligned = ("q_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr", "stride_qb", "stride_qh",
               "stride_ob", "stride_oh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    regs = pg.max_regs(programs_per_sm)
    options = dict(num_warps=pg.NUM_WARPS, **({"maxnreg": regs} if regs else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


# name: compile_sm90 arguments (the knobs the benchmark times, fp16, the GQA groups)
SM90_FORMS: dict[str, dict] = {
    "bf16_p3_s2": {}, "fp16_p3_s2": {"dtype": "fp16"}, "bf16_p2_s3": {"programs_per_sm": 2, "stages": 3},
    "bf16_p1_s6": {"programs_per_sm": 1, "stages": 6}, "bf16_p3_s2_g1": {"group": 1},
    "bf16_p3_s2_g8": {"group": 8},
    "bf16_p2_s2_first": {"programs_per_sm": 2, "first_together": True},
}


def _sm90_report() -> dict:
    """(In a subprocess with the interpreter off.) For each of SM90_FORMS: ptxas -v's registers
    and spills, the shared memory, whether the PTX issues TMA loads, the tile loop's SASS mix.
    {"skip": why} where Gluon cannot compile."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as ex:
        return {"skip": f"no Gluon in this Triton: {ex}"}
    out = {}
    for name, kw in SM90_FORMS.items():
        k = compile_sm90(**kw)
        log, sass = ptxas_sm90a(k.asm["ptx"])
        out[name] = dict(**ptxas_usage(log), shared=k.metadata.shared, threads=32 * k.metadata.num_warps,
                         tma_ptx="cp.async.bulk.tensor" in k.asm["ptx"], loop=tma_mma_loop_mix(sass),
                         programs_per_sm=kw.get("programs_per_sm", 3), stages=kw.get("stages", 2))
    return out


@cpu_only
def test_gluon_bf16_compiles_for_sm90():
    """Per warp per 64-key tile (32 KB of K and V): 8 UTMALDG.3D (one [2, 16, 64] box per page
    piece of K and of V), 8 ldmatrix of K and 8 ldmatrix.trans of V and no other shared load
    or store, 16 HMMA (keys_m: 8 for S^T, 8 for O^T), one mbarrier wait, at most Triton's 10
    bar.syncs, no e4m3 widening, at most 4 + 32 FMUL (the scores' scale, the [128, 8]
    accumulator's rescale), <= 400 instructions (Triton 3.6: 383); no spill under the register
    cap of its programs per SM, and that many programs fit in an SM's registers and shared
    memory. Prints each form's figures."""
    from flashpage.kernels import paged_decode_gluon_bf16 as pg

    rep = run_compiled("test_paged_decode_gluon_bf16", "_sm90_report")
    if "skip" in rep:
        pytest.skip(rep["skip"])
    for name, r in rep.items():
        pps, stages = r["programs_per_sm"], r["stages"]
        print(f"{name}: {r['regs']} registers x {r['threads']} threads, {r['spill_bytes']} bytes spilled, "
              f"{r['shared']} B shared, {pps} programs an SM, ~{pps * (stages - 1) * pg.TILE_BYTES // 1024} KB "
              f"in flight an SM; loop {r['loop']['total']} instructions: {r['loop']}")
        assert r["tma_ptx"] and r["spill_bytes"] == 0, name
        cap = pg.max_regs(pps)
        assert cap is None or r["regs"] <= cap, name
        assert pps * r["regs"] * r["threads"] <= 65536, name
        assert pps * (r["shared"] + 1024) <= 228 * 1024 and pg.fits(pps, stages), name
        assert r["shared"] <= stages * pg.TILE_BYTES + 4096 - 1024, name  # fits()'s 4 KB spare covers it
        loop = r["loop"]
        assert loop["UTMALDG.3D"] == 8 and "UTMALDG.2D" not in loop, name
        assert loop["LDSM.16.M88.4"] == 8 and loop["LDSM.16.MT88.4"] == 8, name
        assert not any(o.startswith(("LDS", "STS")) and not o.startswith("LDSM") for o in loop), name
        hmma = "HMMA.16816.F32.BF16" if name.startswith("bf16") else "HMMA.16816.F32"
        assert loop[hmma] == 16, name
        assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1, name
        assert loop.get("BAR.SYNC.DEFER_BLOCKING", 0) <= 10, name
        assert not any("E4M3" in o for o in loop), name
        assert loop["FMUL"] <= 36 and loop["MUFU.EX2"] <= 6, name
        assert not any(o in loop for o in ("MUFU.RCP", "I2F.RP", "IABS")), name  # no runtime division
        assert loop["total"] <= 400, (name, loop["total"])


def _offset_to_logical(bases: list[list[int]], offset: int) -> tuple[int, ...]:
    """A SharedLinearLayout's logical coordinate of an element offset (XOR of the set bits' bases)."""
    out = [0] * len(bases[0])
    for bit, base in enumerate(bases):
        if offset >> bit & 1:
            out = [a ^ b for a, b in zip(out, base, strict=True)]
    return tuple(out)


def test_gluon_bf16_views_undo_the_swizzle():
    """Where TMA puts each element of a stage ([4 pieces x 2 halves, 16 keys, 64] 16-bit, 128-byte
    swizzle: 16-byte chunk c of 128-byte row (half, key) at chunk c ^ (key % 8)) is where the
    views read it: K [piece, key, dim] and V^T [piece, dim, key], dim = 64 half + 8 chunk + e."""
    from flashpage.kernels import paged_decode_gluon_bf16 as pg

    k_bases = pg._K_ROWS.value.offset_bases
    vt_bases = pg._VT_COLS.value.offset_bases
    assert len(k_bases) == len(vt_bases) == 13  # 8192 elements = 16 KB
    for piece, half, key, chunk, e in itertools.product(range(4), range(2), range(16), range(8), range(8)):
        offset = (((piece * 2 + half) * 16 + key) * 8 + (chunk ^ (key % 8))) * 8 + e
        dim = 64 * half + 8 * chunk + e
        assert _offset_to_logical(k_bases, offset) == (piece, key, dim)
        assert _offset_to_logical(vt_bases, offset) == (piece, dim, key)


def test_gluon_bf16_rejects_what_it_does_not_cover(monkeypatch):
    from flashpage.kernels.paged_decode import gluon_bf16_unsupported
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch, fits, paged_decode_gluon_bf16

    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    cap = (9, 0)

    def only(reasons, word):
        assert len(reasons) == 1 and word in reasons[0], reasons

    assert gluon_bf16_unsupported(q, kc, kc, None, 1, capability=cap) == []
    assert gluon_bf16_unsupported(q.half(), kc.half(), kc.half(), None, 1, capability=cap) == []
    only(gluon_bf16_unsupported(q, kc, kc, None, 1, capability=(8, 0)), "sm_90")
    only(gluon_bf16_unsupported(q, kc, kc, None, 1), "sm_90")  # a CPU tensor
    only(gluon_bf16_unsupported(q, kc.half(), kc.half(), None, 1, capability=cap), "q's dtype")
    kc8 = kc.to(torch.float8_e4m3fn)
    only(gluon_bf16_unsupported(q, kc8, kc8, None, 1, capability=cap), "q's dtype")
    assert "bf16/fp16 query" in " ".join(gluon_bf16_unsupported(q.float(), kc.float(), kc.float(), None, 1,
                                                                capability=cap))
    kc32 = torch.zeros(4, 32, 8, 128, dtype=torch.bfloat16)
    only(gluon_bf16_unsupported(q, kc32, kc32, None, 1, capability=cap), "block_size 16")
    kc64 = torch.zeros(4, 16, 8, 64, dtype=torch.bfloat16)
    only(gluon_bf16_unsupported(q[..., :64], kc64, kc64, None, 1, capability=cap), "head_dim 128")
    kc_t = torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2)  # [4, 16, 8, 128], HND underneath
    only(gluon_bf16_unsupported(q, kc_t, kc_t, None, 1, capability=cap), "contiguous")
    kc2 = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)  # a group of 16
    only(gluon_bf16_unsupported(q, kc2, kc2, None, 1, capability=cap), "1-8 query heads")
    only(gluon_bf16_unsupported(q, kc, kc, 128, 1, capability=cap), "window")
    only(gluon_bf16_unsupported(q, kc, kc, None, 4, capability=cap), "split")

    assert fits(3, 2) and fits(2, 3) and fits(1, 6)
    assert not fits(3, 3) and not fits(4, 2) and not fits(1, 7) and not fits(2, 1)
    with pytest.raises(ValueError, match="variant must be one of"):
        _launch(q, kc, kc, tables, lens, variant="default")
    with pytest.raises(ValueError, match="do not fit"):
        _launch(q, kc, kc, tables, lens, programs_per_sm=3, stages=3)
    with pytest.raises(ValueError, match="q's dtype"):
        _launch(q, kc.half(), kc.half(), tables, lens)
    with pytest.raises(ValueError, match="1-8 query heads"):
        _launch(q, kc2, kc2, tables, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        _launch(q, kc, kc, tables, lens.long())
    if not GPU:
        with pytest.raises(ValueError, match="sm_90"):
            paged_decode_gluon_bf16(q, kc, kc, tables, lens)


def test_balanced_grid():
    """Every program gets ceil(items / programs) items but the last (fewer), never more programs
    than items or than given."""
    from flashpage.kernels.paged_decode_gluon_bf16 import balanced_grid

    assert balanced_grid(512, 396) == 256 and balanced_grid(2048, 396) == 342
    for items in (1, 7, 395, 396, 397, 512, 1024, 2048, 4099):
        for programs in (1, 5, 264, 396):
            g = balanced_grid(items, programs)
            per = -(-items // programs)
            assert 1 <= g <= min(items, programs)
            assert -(-items // g) == per  # the same makespan in items as the full grid
            assert (g - 1) * per < items  # the last program has at least one item


def test_gluon_bf16_switch_and_engine_form(monkeypatch):
    """FLASHPAGE_DECODE_GLUON_BF16 is on unless set to 0; paged_decode's form: 2 programs an SM
    of 2 stages on the balanced grid (H200 run 91), which fits, at any item count."""
    from flashpage import envs
    from flashpage.kernels.paged_decode_gluon_bf16 import engine_form, fits

    monkeypatch.delenv("FLASHPAGE_DECODE_GLUON_BF16", raising=False)
    assert envs.decode_gluon_bf16()
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "1")
    assert envs.decode_gluon_bf16()
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "0")
    assert not envs.decode_gluon_bf16()
    assert engine_form(2048, 132) == engine_form(256, 132) == {"variant": "keys_m", "programs_per_sm": 2,
                                                               "stages": 2, "balance": True,
                                                               "first_together": True}
    for items in (136, 256, 396, 2048):
        form = engine_form(items, 132)
        assert fits(form["programs_per_sm"], form["stages"])


# --------------------------------------------------------------------------- GPU

CASES = [
    [1, 17, 64, 200, 1000, 2048],  # ragged: a single key, part pages, a whole tile, long
    [2048, 1000, 200, 64, 17, 1] * 6,  # longest first, 36 sequences (288 items)
    [65, 63, 128, 129, 191, 192, 193, 15, 16, 33],  # around the tile and page boundaries
]
FORMS = {
    "p3_s2": {}, "p2_s3": {"programs_per_sm": 2, "stages": 3}, "p1_s6": {"programs_per_sm": 1, "stages": 6},
    "p2_s2": {"programs_per_sm": 2, "stages": 2},
    "p2_s2_bal": {"programs_per_sm": 2, "stages": 2, "balance": True},
    # engine_form: the first item's length and block ids in one round trip
    "p2_s2_bal_first": {"programs_per_sm": 2, "stages": 2, "balance": True, "first_together": True},
    "p3_s2_bal": {"balance": True},  # balanced_grid: fewer programs, the same item count each
    # a few programs, many items each: tiles in flight across item boundaries, items shorter than
    # the tiles in flight, the ring wrapping many times
    "p5_s2": {"programs": 5}, "p7_s3": {"programs": 7, "programs_per_sm": 2, "stages": 3},
    "p3_s4": {"programs": 3, "programs_per_sm": 1, "stages": 4}, "p1_s2": {"programs": 1},
    "p5_s2_first": {"programs": 5, "first_together": True},
}


def _case(lens, dtype, seed, hkv=8, hq=32):
    from test_fp8_kv import gen, paged_pair

    g = gen(seed)
    kc, vc, _, _, tables, seq_lens = paged_pair(lens, hkv, 128, 16, dtype, g)
    q = torch.randn(len(lens), hq, 128, generator=g, device="cuda").to(dtype)
    return q, kc, vc, tables, seq_lens, g


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lens", CASES, ids=["ragged", "longest_first", "edges"])
@pytest.mark.parametrize("form", list(FORMS))
def test_gluon_bf16_gpu(form, lens, dtype, monkeypatch):
    """Against paged_decode_ref on the same 16-bit cache (every other slot NaN: a slot read past
    a context poisons the output) per sequence, within the decode tolerance of the dtype, and
    against the Triton kernel within twice it; every output row written (out starts NaN)."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode, paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    q, kc, vc, tables, seq_lens, _ = _case(lens, dtype, sum(lens))
    out = _launch(q, kc, vc, tables, seq_lens, out=torch.full_like(q, float("nan")), **FORMS[form])
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "0")
    triton_out = paged_decode(q, kc, vc, tables, seq_lens)
    assert not out.isnan().any(), "NaN: a slot past a context was read, or a row left unwritten"
    tol = DECODE_TOL[dtype]
    for b in range(len(lens)):  # per sequence, so that one bad length shows by itself
        assert rel_err(out[b], ref[b]) < tol, f"sequence {b} (context {lens[b]}): {rel_err(out[b], ref[b]):.2e}"
    assert rel_err(out, triton_out) < 2 * tol


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("form", ["p3_s2", "p2_s3", "p5_s2"])
def test_gluon_bf16_sharp_scores(form):
    """Queries scaled x 8 (scores with a std of ~11 in log2 units): running maxima jump in the
    middle of sequences, alpha far from 1, P dominated by a few keys."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    lens = [2048, 1000, 333, 64, 17, 1] * 6
    q, kc, vc, tables, seq_lens, _ = _case(lens, torch.bfloat16, 9)
    q = q * 8
    out = _launch(q, kc, vc, tables, seq_lens, out=torch.full_like(q, float("nan")), **FORMS[form])
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    assert not out.isnan().any()
    assert rel_err(out, ref) < DECODE_TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("form", ["p3_s2", "p5_s2"])
def test_gluon_bf16_groups(form, group):
    """GQA groups of 1, 4 and 8 query heads a KV head (padded to 8: all of it real at 8) over 4
    KV heads, against the reference, out starting NaN (every real row written)."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    lens = [1000, 1, 64, 129, 2048, 17]
    q, kc, vc, tables, seq_lens, _ = _case(lens, torch.bfloat16, 13, hkv=4, hq=4 * group)
    out = _launch(q, kc, vc, tables, seq_lens, out=torch.full_like(q, float("nan")), **FORMS[form])
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    assert not out.isnan().any()
    for b in range(len(lens)):
        assert rel_err(out[b], ref[b]) < DECODE_TOL[torch.bfloat16], f"sequence {b} (context {lens[b]})"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("form", ["p3_s2", "p2_s3", "p5_s2", "p7_s3", "p1_s2", "p5_s2_first", "p2_s2_bal_first"])
def test_gluon_bf16_padding_rows(form):
    """seq_len 0 rows (CUDA-graph padding) among others, first, last and in runs, their block
    tables garbage: zeros for them (out starts NaN), the others as the reference; then batches of
    padding only, of one padding row, of one 1-key and of one 17-key sequence."""
    from test_paged_decode_gluon import PADDING_LENS, check_padding_rows

    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    q, kc, vc, tables, seq_lens, _ = _case(PADDING_LENS, torch.bfloat16, 11)
    check_padding_rows(lambda *a, out: _launch(*a, out=out, **FORMS[form]), q, kc, vc, tables, seq_lens)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("form", ["p3_s2", "p2_s2", "p2_s2_bal_first"])
def test_gluon_bf16_cuda_graph(form):
    """Captured once, replayed with new queries and lengths (descriptors are kernel parameters:
    the caches must stay where they were), then again with a padding row (seq_len 0: zeros)."""
    from test_paged_decode_gluon import check_graph_replay

    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    q, kc, vc, tables, lens, g = _case([900, 20, 2000], torch.bfloat16, 5)
    check_graph_replay(lambda *a, out: _launch(*a, out=out, **FORMS[form]), q, kc, vc, tables, lens, g)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch", [24, 48, 300])
def test_paged_decode_routes_bf16_to_gluon(batch, dtype, monkeypatch):
    """paged_decode itself (the engine's call) at unsplit 16-bit batches (24 / 48 / 300 sequences x
    8 KV heads: engine_form's balanced 2 programs an SM of 2 stages): with FLASHPAGE_DECODE_GLUON_BF16=1 it
    calls the Gluon kernel (spied) and matches the reference and the Triton kernel; set to 0,
    it does not call it."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels import paged_decode_gluon_bf16 as g16
    from flashpage.kernels.paged_decode import (
        _num_sms,
        choose_num_splits,
        default_config,
        paged_decode,
        paged_decode_ref,
    )

    lens = ([2048, 1000, 200, 64, 17, 1] * 50)[:batch]
    q, kc, vc, tables, seq_lens, _ = _case(lens, dtype, batch)
    calls = []
    real = g16.plan
    monkeypatch.setattr(g16, "plan", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "1")
    cfg = default_config(kc.device, 128, batch * 8)
    assert cfg.gluon and choose_num_splits(batch, 8, tables.shape[1] * 16, _num_sms(kc.device),
                                           programs_per_sm=cfg.programs_per_sm) == 1
    out = paged_decode(q, kc, vc, tables, seq_lens, out=torch.full_like(q, float("nan")))
    assert len(calls) == 1
    assert {k: calls[0][k] for k in ("programs_per_sm", "stages", "balance", "first_together")} == {
        "programs_per_sm": 2, "stages": 2, "balance": True, "first_together": True}
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "0")
    triton_out = paged_decode(q, kc, vc, tables, seq_lens)
    assert len(calls) == 1, "the Gluon kernel ran with the switch off"
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    assert not out.isnan().any()
    tol = DECODE_TOL[dtype]
    assert rel_err(out, ref) < tol and rel_err(out, triton_out) < 2 * tol
