"""The Gluon 16-bit paged decode (kernels/paged_decode_gluon_bf16.py).

CPU: the kernel compiled for sm_90 (Triton's ptxas and nvdisasm, no GPU): the pages arrive
by 3-D TMA boxes (one per page piece of K, one of V), nothing spills, and the main loop reads
K by ``ldmatrix`` and V by ``ldmatrix.trans`` only (no other shared load), 8 of each per warp
per 64-key tile; registers and shared memory allow 3 programs per SM at STAGES 2 and 2 at 3.
Bad input raises ValueError naming what is wrong (checked before the device).
GPU (marked gpu): against paged_decode_ref on the same bf16 cache (every slot no sequence
owns NaN) and against the Triton kernel, over ragged contexts, GQA groups 1-16, both STAGES,
an fp16 cache, and a CUDA-graph replay.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from sm90 import run_compiled  # tests/kernels (on sys.path under pytest)
from test_paged_decode_gluon import _sass_instructions

GPU = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(GPU, reason="the sm_90 compile without a GPU")

SM_REGS, SM_SHARED = 65536, 227 * 1024


# --------------------------------------------------------------------------- sm_90 compile (CPU)


def compile_sm90(group: int = 4, stages: int | None = None, dtype: str = "bf16", max_regs: int | None = None,
                 ws: bool = False, lazy: bool = False, half_boxes: bool = False):
    """The kernel compiled for sm_90 as an H200 launch compiles it (q, caches and out in
    ``dtype``; pointers and the strides that are multiples of 16 there marked so). ``ws``: the
    warp-specialized variant, launched as ``_launch`` does (maxnreg ``max_regs`` or
    WS_MAXNREG[stages], the compute warps' setmaxnreg from it). ``half_boxes``: 2-D boxes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashpage.kernels import paged_decode_gluon_bf16 as pg

    fn = pg._paged_decode_gluon_bf16_ws_kernel if ws else pg._paged_decode_gluon_bf16_kernel
    consts = {"GROUP": group, "STAGES": stages or pg.STAGES, "HALF_BOXES": half_boxes}
    if ws:
        max_regs = max_regs or pg.WS_MAXNREG[consts["STAGES"]]
        consts.update(LAZY=lazy, COMPUTE_REGS=pg.ws_compute_regs(max_regs))
    desc = f"tensordesc<{dtype}[2, {pg.PAGE}, {pg.HALF}],{pg._TMA_SMEM.value!r}>"
    if half_boxes:
        desc = f"tensordesc<{dtype}[{pg.PAGE}, {pg.HALF}],{pg._TMA_SMEM_2D.value!r}>"
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({"q_ptr": f"*{dtype}", "k_desc": desc, "v_desc": desc, "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "out_ptr": f"*{dtype}", "sm_scale_log2": "fp32"})
    sig.update({c: "constexpr" for c in consts})
    aligned = ("q_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr", "stride_qb", "stride_qh",
               "stride_ob", "stride_oh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = dict(num_warps=pg.NUM_WARPS, **({"maxnreg": max_regs} if max_regs else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_loop_mix(sass: str) -> dict[str, int]:
    """Opcode counts of the main loop (the shortest backward-branch span holding both a TMA
    issue and an HMMA), modifiers kept (``LDSM.16.MT88.4``)."""
    ins, labels = _sass_instructions(sass)
    loops = [(labels[m[1]], i) for i, t in enumerate(ins)
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)) and labels.get(m[1], i + 1) <= i]
    bodies = [[t.split(" ")[0] for t in ins[lo:hi + 1]] for lo, hi in loops]
    body = min((b for b in bodies if any(o.startswith("UTMALDG") for o in b)
                and any(o.startswith("HMMA") for o in b)), key=len)
    mix = collections.Counter(body)
    mix["total"] = len(body)
    return dict(mix)


def sass_ws_loops(sass: str) -> dict:
    """The warp-specialized kernel's loops by partition: each instruction's register budget is
    that of the last USETMAXREG before it; the loops are the backward branches before the last
    EXIT (the mbarrier retry stubs after it excluded) holding no USETMAXREG (the workers'
    dispatch loop). Returns the opcode mix (and budget) of each loop holding an HMMA
    (``compute``) or a TMA issue (``producer``), the budgets under which UTMALDG and HMMA occur,
    and the highest register used under each budget."""
    ins, labels = _sass_instructions(sass)
    budget, cur = [], None
    for t in ins:
        if m := re.match(r"USETMAXREG\.\S+\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)", t):
            cur = int(m[1], 16)
        budget.append(cur)
    last_exit = max(i for i, t in enumerate(ins) if t.startswith("EXIT"))
    loops = [(labels[m[1]], i) for i, t in enumerate(ins[:last_exit])
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)) and labels.get(m[1], i + 1) <= i]
    out: dict = {"compute": [], "producer": []}
    for lo, hi in loops:
        body = [t.split(" ")[0] for t in ins[lo:hi + 1]]
        if any(o.startswith("USETMAXREG") for o in body):
            continue
        mix: dict = collections.Counter(body)
        mix["total"] = len(body)
        mix["budget"] = budget[lo]
        if any(o.startswith("HMMA") for o in body):
            out["compute"].append(dict(mix))
        elif any(o.startswith("UTMALDG") for o in body):
            out["producer"].append(dict(mix))
    out["utmaldg_budgets"] = sorted({budget[i] for i, t in enumerate(ins) if t.startswith("UTMALDG")})
    out["hmma_budgets"] = sorted({budget[i] for i, t in enumerate(ins) if t.startswith("HMMA")})
    top: dict = collections.defaultdict(int)
    for b, t in zip(budget, ins, strict=True):
        for r in re.findall(r"\bR(\d+)\b", t):
            top[b] = max(top[b], int(r) + 1)
    out["registers_used"] = {str(b): n for b, n in top.items() if b}
    return out


VARIANTS: dict[str, dict] = {  # name: compile_sm90 arguments
    "stages2": {},
    "stages3": {"stages": 3},
    "fp16": {"dtype": "fp16"},
    "ws": {"ws": True},
    "ws_lazy": {"ws": True, "lazy": True},
    "ws_stages3": {"ws": True, "stages": 3},
    "half_boxes": {"half_boxes": True},
    "ws_half_boxes": {"ws": True, "half_boxes": True},
}


def _sm90_report() -> dict:
    """(In a subprocess with the interpreter off.) ptxas -v's registers and spills, the shared
    memory, the threads, whether the PTX issues TMA loads, and the main loop's SASS mix, for
    each of VARIANTS. {"skip": why} where Gluon cannot compile."""
    import triton

    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as ex:
        return {"skip": f"no Gluon in this Triton: {ex}"}
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out = {}
    for name, kw in VARIANTS.items():
        k = compile_sm90(**kw)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(k.asm["ptx"])
            r = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"],
                               cwd=tmp, capture_output=True, text=True, check=True)
            sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", "k.cubin"], cwd=tmp,
                                  capture_output=True, text=True, check=True).stdout
        regs = int(re.findall(r"Used (\d+) registers", r.stderr)[0])
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr)]
        out[name] = dict(regs=regs, spill_bytes=sum(spills), shared=k.metadata.shared,
                         threads=32 * k.metadata.num_warps,
                         tma_ptx=f"cp.async.bulk.tensor.{2 if kw.get('half_boxes') else 3}d" in k.asm["ptx"])
        out[name].update(sass_ws_loops(sass) if kw.get("ws") else {"loop": sass_loop_mix(sass)})
    return out


def programs_per_sm(regs: int, threads: int, shared: int) -> int:
    """Resident programs per H100/H200 SM: registers allocated 8 a thread at a time, 227 KB
    of shared memory a block can use in all."""
    return min(SM_REGS // (-(-regs // 8) * 8 * threads), SM_SHARED // shared)


def _check_compute_loop(name: str, loop: dict, hmma: str = "HMMA.16816.F32.BF16") -> None:
    """Per warp per 64-key tile: 8 ldmatrix of K, 8 ldmatrix.trans of V, no other shared load,
    no local memory, no widening; 32 HMMA; one mbarrier wait."""
    assert loop["LDSM.16.M88.4"] == 8 and loop["LDSM.16.MT88.4"] == 8, name
    assert not any(o.startswith("LDS") and not o.startswith("LDSM") for o in loop), name
    assert not any(o.startswith(("LDL", "STL", "F2FP.F16.E4M3", "PRMT")) for o in loop), name
    assert loop[hmma] == 32, name
    assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1, name


@cpu_only
def test_gluon_bf16_decode_compiles_for_sm90():
    """3-D TMA loads (8 a tile: one box per page piece of K and of V; ``half_boxes``: 16 2-D),
    no spill, the loop of _check_compute_loop; 3 programs per SM at STAGES 2, 2 at STAGES 3. The warp-specialized
    variant: 4 one-warp compute loops of that mix with no bar.sync and no TMA issue, every
    UTMALDG in the producer (8 a tile), no register past the compute warps' budget; 3 programs
    per SM at STAGES 2, 2 at 3. Prints registers, shared memory, programs per SM, the loops."""
    from flashpage.kernels import paged_decode_gluon_bf16 as pg

    rep = run_compiled("test_paged_decode_gluon_bf16", "_sm90_report")
    if "skip" in rep:
        pytest.skip(rep["skip"])
    for name, r in rep.items():
        print(f"{name}: {r['regs']} registers x {r['threads']} threads, {r['spill_bytes']} bytes spilled, "
              f"{r['shared']} B shared, {programs_per_sm(r['regs'], r['threads'], r['shared'])} programs per SM")
        for key in ("loop", "compute", "producer", "utmaldg_budgets", "hmma_budgets", "registers_used"):
            if key in r:
                print(f"  {key}: {r[key][:1] if key == 'compute' else r[key]}")
    for name, r in rep.items():
        assert r["tma_ptx"] and r["spill_bytes"] == 0, name
        hmma = "HMMA.16816.F32" if name == "fp16" else "HMMA.16816.F32.BF16"
        boxes = {"UTMALDG.2D": 16} if VARIANTS[name].get("half_boxes") else {"UTMALDG.3D": 8}
        if "loop" in r:
            assert {o: r["loop"].get(o) for o in boxes} == boxes, name  # 4 K + 4 V page pieces a tile
            _check_compute_loop(name, r["loop"], hmma)
            continue
        stages = VARIANTS[name].get("stages", pg.STAGES)
        compute_regs = pg.ws_compute_regs(pg.WS_MAXNREG[stages])
        assert r["threads"] == 256 and r["regs"] == pg.WS_MAXNREG[stages], name
        assert len(r["compute"]) == 4, name  # one loop per one-warp compute partition
        for c in r["compute"]:
            assert c["budget"] == compute_regs, name
            assert not any(o.startswith(("BAR", "UTMA")) for o in c), name  # no bar.sync, no TMA issue
            assert c["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, name  # the stage's empty barrier
            _check_compute_loop(name, c, hmma)
        assert len(r["producer"]) == 1 and {o: r["producer"][0].get(o) for o in boxes} == boxes, name
        assert r["utmaldg_budgets"] == [r["producer"][0]["budget"]] == [2 * r["regs"] - compute_regs], name
        assert r["hmma_budgets"] == [compute_regs], name
        assert r["registers_used"][str(compute_regs)] <= compute_regs, name
    for name, per_sm in (("stages2", 3), ("stages3", 2), ("ws", 3), ("ws_stages3", 2)):
        r = rep[name]
        assert programs_per_sm(r["regs"], r["threads"], r["shared"]) == per_sm, name


def test_gluon_bf16_decode_rejects_what_it_does_not_cover():
    """Each bad input raises ValueError naming it, before the device is looked at."""
    from flashpage.kernels.paged_decode_gluon_bf16 import paged_decode_gluon_bf16

    def call(q=None, kc=None, vc=None, tables=None, lens=None, **kw):
        q = torch.zeros(2, 32, 128, dtype=torch.bfloat16) if q is None else q
        kc = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16) if kc is None else kc
        vc = kc if vc is None else vc
        tables = torch.zeros(2, 2, dtype=torch.int32) if tables is None else tables
        lens = torch.ones(2, dtype=torch.int32) if lens is None else lens
        return paged_decode_gluon_bf16(q, kc, vc, tables, lens, **kw)

    with pytest.raises(ValueError, match="q's dtype"):
        call(kc=torch.zeros(4, 16, 8, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="q's dtype"):
        call(kc=torch.zeros(4, 16, 8, 128).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="q must be bf16/fp16"):
        call(q=torch.zeros(2, 32, 128))
    with pytest.raises(ValueError, match="128"):
        call(q=torch.zeros(2, 32, 64, dtype=torch.bfloat16), kc=torch.zeros(4, 16, 8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        call(kc=torch.zeros(4, 32, 8, 128, dtype=torch.bfloat16))  # block size 32
    with pytest.raises(ValueError, match="contiguous"):
        call(kc=torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="differ"):
        call(vc=torch.zeros(5, 16, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1-16 times"):
        call(q=torch.zeros(2, 12, 128, dtype=torch.bfloat16))  # 12 / 8
    with pytest.raises(ValueError, match="1-16 times"):
        call(kc=torch.zeros(4, 16, 1, 128, dtype=torch.bfloat16))  # group 32
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(tables=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        call(lens=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.zeros(2, 32, 128))
    if not GPU:
        with pytest.raises(ValueError, match="sm_90"):
            call()  # everything else right: the device
    else:
        with pytest.raises(ValueError, match="is on"):
            call(q=torch.zeros(2, 32, 128, dtype=torch.bfloat16, device="cuda"))


# --------------------------------------------------------------------------- GPU

hopper = pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs an sm_90 GPU")

LENS = {
    "ragged": [1, 17, 64, 200, 1000, 2048, 4099],  # a single key, part pages, a whole tile, long
    "longest_first": [2048, 1000, 200, 64, 17, 1] * 6 + [33],  # 37 sequences
    "tile_edges": [65, 63, 128, 129, 191, 192, 193, 16, 15, 80, 100],
}
GROUPS = {1: (8, 8), 4: (32, 8), 8: (32, 4), 16: (32, 2)}  # group: (Hq, Hkv)


def _case(lens, group, dtype=torch.bfloat16, seed=0):
    from test_fp8_kv import gen, paged_pair

    hq, hkv = GROUPS[group]
    g = gen(seed + sum(lens) + group)
    kc, vc, _, _, tables, seq_lens = paged_pair(lens, hkv, 128, 16, dtype, g)  # unowned slots NaN
    q = torch.randn(len(lens), hq, 128, generator=g, device="cuda").to(dtype)
    return q, kc, vc, tables, seq_lens


LAUNCH = {  # _launch knobs
    "s2": {"stages": 2}, "s3": {"stages": 3}, "ws": {"warp_specialize": True},
    "ws_lazy": {"warp_specialize": True, "lazy": True}, "ws_s3": {"warp_specialize": True, "stages": 3},
    "hb": {"half_boxes": True}, "ws_hb": {"warp_specialize": True, "half_boxes": True},
}
# The default (s2) and ws over every GQA group; the other variants over groups 4 and 8, the
# 2-D boxes over group 4.
GPU_CASES = ([(v, g) for v in ("s2", "ws") for g in GROUPS] + [(v, g) for v in ("s3", "ws_lazy", "ws_s3") for g in (4, 8)]
             + [("hb", 4), ("ws_hb", 4)])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(LENS.values()), ids=list(LENS))
@pytest.mark.parametrize("variant,group", GPU_CASES, ids=[f"{v}-group{g}" for v, g in GPU_CASES])
def test_paged_decode_gluon_bf16_gpu(lens, variant, group):
    """Against paged_decode_ref within the bf16 decode tolerance, per sequence, and against
    the Triton kernel; every output row written (out starts NaN), no NaN from a slot past a
    context."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode, paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    q, kc, vc, tables, seq_lens = _case(lens, group)
    out = _launch(q, kc, vc, tables, seq_lens, out=torch.full_like(q, float("nan")), **LAUNCH[variant])
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    triton_out = paged_decode(q, kc, vc, tables, seq_lens)
    assert not out.isnan().any(), "NaN: a slot past a context was read, or a row left unwritten"
    tol = DECODE_TOL[torch.bfloat16]
    for b in range(len(lens)):  # per sequence, so that one bad length shows by itself
        assert rel_err(out[b], ref[b]) < tol, f"sequence {b} (context {lens[b]}): {rel_err(out[b], ref[b]):.2e}"
    assert rel_err(out, triton_out) < 2 * tol


@pytest.mark.gpu
@hopper
def test_paged_decode_gluon_bf16_lazy_large_scores_gpu():
    """Lazy rescaling where row maxima jump by far more than 2^8 between tiles (q scaled 8x,
    keys 1-5x by slot): the rescales it does take keep p finite and the result right."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    lens = [3000, 700, 129]
    q, kc, vc, tables, seq_lens = _case(lens, 4, seed=11)
    ramp = torch.linspace(0.0, 4.0, 16, device="cuda").view(1, 16, 1, 1)  # within each page
    kc.mul_(1.0 + ramp)
    q.mul_(8.0)
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens)
    for kw in (LAUNCH["ws_lazy"], LAUNCH["s2"]):
        out = _launch(q, kc, vc, tables, seq_lens, **kw)
        assert not out.isnan().any() and rel_err(out, ref) < DECODE_TOL[torch.bfloat16], kw


@pytest.mark.gpu
@hopper
def test_paged_decode_gluon_bf16_fp16_and_scale_gpu():
    """An fp16 cache and q, and a given sm_scale."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import paged_decode_gluon_bf16

    q, kc, vc, tables, seq_lens = _case(LENS["ragged"], 4, torch.float16)
    out = paged_decode_gluon_bf16(q, kc, vc, tables, seq_lens, sm_scale=0.05)
    ref = paged_decode_ref(q, kc, vc, tables, seq_lens, sm_scale=0.05)
    assert out.dtype == torch.float16 and not out.isnan().any()
    assert rel_err(out, ref) < DECODE_TOL[torch.float16]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", ["s2", "s3", "ws"])
def test_paged_decode_gluon_bf16_cuda_graph(variant):
    """Captured once, replayed with new queries and lengths (descriptors are kernel
    parameters: the caches must stay where they were)."""
    from test_fp8_kv import DECODE_TOL, rel_err

    from flashpage.kernels.paged_decode import paged_decode_ref
    from flashpage.kernels.paged_decode_gluon_bf16 import _launch

    q, kc, vc, tables, lens = _case([900, 20, 2000], 4, seed=5)
    out = torch.empty_like(q)
    _launch(q, kc, vc, tables, lens, out=out, **LAUNCH[variant])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(q, kc, vc, tables, lens, out=out, **LAUNCH[variant])
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([5, 20, 1999], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_decode_ref(q, kc, vc, tables, lens)
    assert rel_err(out, ref) < DECODE_TOL[torch.bfloat16]
