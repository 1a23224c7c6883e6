"""The int4 fused MoE kernel's "swap" form (kernels/fused_moe_int4.py: the decoded weight
tile wgmma's first operand, out^T = (q - z) . x^T, the group's scale on each K tile's
fp32 sums), decoded from 32-bit words by inline PTX on the GPU.

CPU: the inline PTX (which the interpreter cannot run) replayed in torch from its own text
for every nibble at every position with every zero point 0-16, in bf16 and fp16, through
_int4_word's output order; the interpreter's word decode (fp32 / fp16) for the same; the
kernels against the reference (the 16-bit kernel's over the dequantized experts) and the
"dot" form in fp32 / fp16 (ragged routing, an expert over several blocks, groups of 128,
256 and a whole row, 64-256 features a tile with features past the end, 16 / 32 rows a
block, symmetric zeros, unread experts' NaN scales); default_config's choice; errors (the
meta-tensor no-host-sync check: test_fused_moe_int4.py, both forms); the kernels built for sm_90a: wgmma with the weights from
registers, the decode's lop3 / packed adds as counted, no shared-memory round trip of the
weights unpipelined, no spills, and the K loop's SASS per weight under 0.4x "dot"'s.
GPU (marked gpu): the inline PTX decode of every nibble with every zero, bf16 and fp16 at
Qwen3-30B-A3B's expert shape and several token counts and tiles against the reference.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl
from test_fused_moe import routing  # tests/kernels
from test_fused_moe_int4 import _rel, int4_experts  # tests/kernels
from test_fused_moe_mxfp4_swap import every_nibble_words, nibble, store8  # tests/kernels

from flashpage.kernels import fused_moe_int4 as fm4
from flashpage.kernels import fused_moe_int4_swap as fm4s
from flashpage.kernels.fused_moe_int4 import (
    FusedMoEInt4Config,
    default_config,
    fused_moe_int4,
    fused_moe_int4_ref,
)
from flashpage.kernels.int4_gemm import _UNPACK_TYPES, _unpack_ptx

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
cpu_only = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

# _int4_word's outputs: the nibbles (positions in a word) 0, 4, 1, 5, 2, 6, 3, 7
WORD_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
SWAP = FusedMoEInt4Config(block_m=16, block_n=64, block_k=128, form="swap")


def words_and_zeros() -> tuple[torch.Tensor, torch.Tensor]:
    """Every word of every_nibble_words with every zero point 0-16: [17 * 256] each."""
    return every_nibble_words().repeat(17), torch.arange(17).repeat_interleave(256).to(torch.uint8)


def replay_ptx(ptx: str, words: torch.Tensor, h_in: dict[int, torch.Tensor],
               dtype: torch.dtype) -> list:
    """The unpack PTX run in torch, line by line from its text (int64 for the 32-bit ops,
    16-bit arithmetic rounded to ``dtype``): its 8 outputs $0..$7 for words [n] ($8) and
    the 16-bit operands ``h_in`` (operand number -> [n])."""
    regs: dict[str, torch.Tensor | int] = {}
    outs: dict[int, torch.Tensor] = {}
    w = words.to(torch.int64) & 0xFFFFFFFF

    def val(a: str):
        a = a.strip()
        return w if a == "$8" else regs[a] if a in regs else int(a, 0)

    def halves(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = v & 0xFFFF, v >> 16
        return tuple(torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(dtype).float()
                     for h in (lo, hi))

    def pack(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        bits = [h.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF for h in (lo, hi)]
        return bits[0] | (bits[1] << 16)

    for line in (ln.strip().rstrip(";") for ln in ptx.splitlines()):
        op, _, args = line.partition(" ")
        a = [x.strip() for x in args.split(",")] if args else []
        if op == "mov.b32" and a[1].startswith("{$"):  # mov.b32 nz, {$9, $9}
            v = h_in[int(a[1][2:])]
            assert a[2] == a[1][1:] + "}"
            regs[a[0]] = pack(v.float(), v.float())
        elif op == "mov.b32" and a[0].startswith("{"):  # mov.b32 {$i, $j}, p
            lo, hi = halves(regs[a[2]])
            outs[int(a[0][2:])], outs[int(a[1][1:-1])] = lo, hi
        elif op == "mov.b32":
            regs[a[0]] = torch.as_tensor(val(a[1]), dtype=torch.int64)
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "lop3.b32":
            assert a[4] == "0xEA"  # a & b | c
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op.startswith("fma.rn."):  # p * one + nz, per half, rounded to the 16-bit type
            (p0, p1), (o0, o1), (c0, c1) = (halves(regs[x]) for x in a[1:4])
            regs[a[0]] = pack((p0 * o0 + c0).to(dtype).float(), (p1 * o1 + c1).to(dtype).float())
        else:
            assert op in ("{", "}", ".reg"), line
    assert sorted(outs) == list(range(8))
    return [outs[i] for i in range(8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpack_ptx_gives_q_minus_z_in_word_order(dtype):
    """The PTX _int4_word runs on the GPU (fm4s.word_ptx: int4_gemm's for bf16, three
    shifts a word; F16_WORD_PTX for fp16, one), replayed in torch from its own text for
    every nibble at every position with every zero point 0-16 (the 16-bit operands
    _int4_word passes: -(magic + z), exact): output $i is nibble i's q - z, exactly, so
    _int4_word's (n0, n4, n1, n5, ...) is WORD_ORDER."""
    words, z = words_and_zeros()
    ptx, offset = fm4s.word_ptx(dtype)
    magics = {9: offset} if dtype == torch.bfloat16 else {9: 1024.0, 10: 64.0}
    assert offset == _UNPACK_TYPES[dtype][1]
    assert (dtype == torch.float16) == (ptx != _unpack_ptx(dtype))
    h_in = {i: (-(z.float() + m)).to(dtype) for i, m in magics.items()}
    for i, m in magics.items():
        assert torch.equal(h_in[i].float(), -(z.float() + m))  # exact
    outs = replay_ptx(ptx, words, h_in, dtype)
    for i in range(8):
        assert torch.equal(outs[i], nibble(words, i).float() - z.float()), (dtype, i)
    shifts = len(re.findall(r"^shr\.u32", ptx, re.M))
    assert shifts == (3 if dtype == torch.bfloat16 else 1)
    with pytest.raises(ValueError, match="no inline-PTX int4 decode for torch.float32"):
        fm4s.word_ptx(torch.float32)


@triton.jit
def _word_kernel(w_ptr, z_ptr, out_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr,
                 ASM: tl.constexpr, PTX: tl.constexpr, OFFSET: tl.constexpr):
    """out [n, 8] = fm4s._int4_word of words [n] with zero points [n]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    word = tl.load(w_ptr + offs, mask=mask, other=0)
    z = tl.load(z_ptr + offs, mask=mask, other=0)
    o0, o1, o2, o3, o4, o5, o6, o7 = fm4s._int4_word(word, z, DT, ASM, PTX, OFFSET)
    store8(out_ptr + offs * 8, mask, o0, o1, o2, o3, o4, o5, o6, o7)


def assert_word_decode(dtype: torch.dtype, asm: bool) -> None:
    """Every nibble at every position with every zero point: q - z in WORD_ORDER."""
    words, z = words_and_zeros()
    n = words.numel()
    out = torch.full((n, 8), 99.0, dtype=dtype, device=DEV)  # 99: no q - z
    dt = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    ptx, offset = fm4s.word_ptx(dtype) if asm else ("", 0.0)
    _word_kernel[(triton.cdiv(n, 1024),)](
        words.to(DEV), z.to(DEV), out, n, DT=dt[dtype], BLOCK=1024, ASM=asm, PTX=ptx,
        OFFSET=offset)
    want = torch.stack([nibble(words, m) for m in WORD_ORDER], 1).float() - z.float()[:, None]
    assert torch.equal(out.cpu().float(), want), (dtype, asm)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_word_decode_every_nibble_every_zero_interpreter(dtype):
    """The Triton decode (no inline PTX), as the interpreter and fp32 take it."""
    assert_word_decode(dtype, asm=False)


CASES = [  # t, k, e, hidden, inter, g1, g2 (None: a whole row), crowd, sym, cfg
    (1, 4, 8, 256, 128, 128, 128, 0, False, SWAP),
    (13, 3, 8, 384, 256, 128, None, 5, False, SWAP),          # down: one group a row of 256
    (37, 4, 16, 256, 128, None, 128, 20, True, FusedMoEInt4Config(
        block_m=32, block_n=128, block_k=128, num_stages=1, form="swap")),  # 20 on experts 0-3
    (9, 2, 4, 256, 384, 256, 128, 0, False, FusedMoEInt4Config(
        block_m=16, block_n=256, block_k=128, form="swap")),  # 384 / 256: features past the end
]


def _case(t, k, e, h, inter, g1, g2, crowd, sym, dtype):
    ids, w = routing(t, k, e, seed=t, crowd=crowd)
    chosen = set(ids.flatten().tolist())
    unused = tuple(i for i in range(e) if i not in chosen)
    gu = int4_experts(e, 2 * inter, h, g1, seed=1, sym=sym, unused=unused)
    dn = int4_experts(e, h, inter, g2, seed=2, sym=sym, unused=unused)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    return x, gu, dn, ids, w


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "g1", "g2", "crowd", "sym", "cfg"), CASES)
def test_swap_matches_the_reference(dtype, t, k, e, h, inter, g1, g2, crowd, sym, cfg):
    """"swap" against the reference over the dequantized experts and against "dot": fp32
    to fp32's sums order, fp16 within its rounding; experts nobody chose (NaN scales) are
    never read; one expert's scales doubled move the output (the test could fail)."""
    x, gu, dn, ids, w = _case(t, k, e, h, inter, g1, g2, crowd, sym, dtype)
    got = fused_moe_int4(x, *gu, *dn, ids, w, cfg)
    want = fused_moe_int4_ref(x, *gu, *dn, ids, w)
    dot = fused_moe_int4(x, *gu, *dn, ids, w, FusedMoEInt4Config(block_m=16, block_n=64))
    assert got.dtype == dtype and got.shape == (t, h) and torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got, dot, atol=2e-5, rtol=2e-5)
    else:
        assert _rel(got, want) < 5e-3 and _rel(got, dot) < 5e-3
    e0 = int(ids[0, 0])
    dn_s = dn[1].clone()
    dn_s[e0] *= 2
    moved = fused_moe_int4(x, *gu, dn[0], dn_s, dn[2], ids, w, cfg)
    assert not torch.equal(moved, got)
    assert _rel(moved, fused_moe_int4_ref(x, *gu, dn[0], dn_s, dn[2], ids, w)) < 5e-3


def test_default_config_takes_swap_where_it_runs():
    """16-bit x and groups that are multiples of 128: "swap" at every size (3 stages; 16 rows
    up to a mean of 16 pairs an expert, 32 past it: run 200); fp32, groups of 64 or no
    groups given: "dot" as before (16 rows to a mean of 16, 64 rows on 8 warps past it)."""
    bf, fp16 = torch.bfloat16, torch.float16
    for pairs, bm in ((8, 16), (8 * 128, 16), (16 * 128, 16), (16 * 128 + 1, 32), (4096 * 8, 32)):
        for dt, groups in ((bf, (128, 128)), (fp16, (256, 2048))):
            cfg = default_config(pairs, 128, dt, groups)
            assert (cfg.form, cfg.block_m, cfg.num_stages, cfg.block_k) == ("swap", bm, 3, 128)
    for dt, groups, pairs in ((torch.float32, (128, 128), 8), (bf, (64, 128), 8),
                              (bf, (128, 32), 8), (bf, None, 8), (None, (128, 128), 8)):
        assert default_config(pairs, 128, dt, groups) == FusedMoEInt4Config(block_k=64)
    big = default_config(16 * 128 + 1, 128, bf, (64, 128))
    assert (big.form, big.block_m, big.num_warps) == ("dot", 64, 8)
    assert SWAP.name == "swap m16 n64 k128 w4 s3"


def test_swap_errors():
    with pytest.raises(ValueError, match="'swap' takes K tiles of 128.*got block_k 64, block_n 64"):
        FusedMoEInt4Config(block_k=64, form="swap")
    with pytest.raises(ValueError, match="block_n a multiple of 64.*block_n 32"):
        FusedMoEInt4Config(block_n=32, form="swap")
    with pytest.raises(ValueError, match="form must be one of dot, swap; got 'swapped'"):
        FusedMoEInt4Config(form="swapped")
    ids, w = routing(3, 2, 4, seed=0)
    gu = int4_experts(4, 256, 128, 64, seed=1)
    dn = int4_experts(4, 128, 128, 128, seed=2)
    x = torch.randn(3, 128, device=DEV)
    with pytest.raises(ValueError, match=r"multiples of 128.*got 64 \(gate_up\) and 128 \(down\)"):
        fused_moe_int4(x, *gu, *dn, ids, w, SWAP)


# ----------------------------------------------------------------- sm_90a SASS (no GPU)
# (kernel, form, block_m, block_n, block_k, warps, stages, dtype): the defaults ("swap" at
# 16 rows / 3 stages and 32 rows / 1 stage; "dot" at 16 rows), swap unpipelined at 16 rows,
# and fp16
SASS_CASES = [(kern, *c) for kern in ("gate_up", "down") for c in (
    ("swap", 16, 64, 128, 4, 3, "bf16"), ("swap", 16, 64, 128, 4, 1, "bf16"),
    ("swap", 32, 64, 128, 4, 1, "bf16"), ("swap", 32, 64, 128, 4, 3, "bf16"),
    ("swap", 16, 64, 128, 4, 3, "fp16"),
    ("dot", 16, 64, 64, 4, 3, "bf16"), ("dot", 16, 64, 128, 8, 3, "bf16"))]


def _compile_int4_swap_kernels() -> list[dict]:
    """(In a subprocess with the interpreter off.) SASS_CASES compiled for sm_90 as a launch
    specializes them (groups of 128): each K loop's SASS (the longest backward-branch span
    holding an MMA) counted, and its instructions per weight and thread."""
    import collections

    from sm90 import compile_sm90, ptxas_sm90a, ptxas_usage, sass_instructions, sass_loops

    out = []
    for kern, form, bm, bn, bk, warps, stages, dt in SASS_CASES:
        torch_dt = torch.bfloat16 if dt == "bf16" else torch.float16
        ptr = {"x_ptr": f"*{dt}", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
               "act_ptr": f"*{dt}", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
               "a_ptr": f"*{dt}", "topk_w_ptr": "*fp32", "ys_ptr": f"*{dt}"}
        consts = dict(G=128, DT=tl.bfloat16 if dt == "bf16" else tl.float16, BLOCK_M=bm,
                      BLOCK_N=bn, PRECISION="tf32")
        if form == "swap":
            ptx, offset = fm4s.word_ptx(torch_dt)
            consts.update(ASM=True, PTX=ptx, OFFSET=offset)
            fn = (fm4s._int4_swap_gate_up_kernel if kern == "gate_up"
                  else fm4s._int4_swap_down_kernel)
        else:
            consts["BLOCK_K"] = bk
            fn = fm4._int4_gate_up_kernel if kern == "gate_up" else fm4._int4_down_kernel
        aligned = [a for a in fn.arg_names
                   if a.endswith("_ptr") or a in ("hidden", "inter") or a.startswith("stride_")]
        k = compile_sm90(fn, consts, ptr, num_warps=warps, num_stages=stages, aligned=aligned)
        log, sass = ptxas_sm90a(k.asm["ptx"])
        ins, labels = sass_instructions(sass)
        spans = [ins[lo:hi + 1] for lo, hi in sass_loops(ins, labels)]
        loop = max((b for b in spans if any(t.startswith(("HGMMA", "HMMA")) for t in b)), key=len)
        ops = collections.Counter(t.split(" ")[0] for t in loop)
        weights = (2 if kern == "gate_up" else 1) * bn * bk
        out.append(dict(
            kernel=kern, form=form, block_m=bm, warps=warps, stages=stages, dtype=dt,
            loop=len(loop),
            per_weight=round(len(loop) * 32 * warps / weights, 2),
            hgmma=sum(n for o, n in ops.items() if o.startswith("HGMMA")),
            hgmma_reg_a=sum(bool(re.match(r"HGMMA\S* R\d+, R\d+, gdesc", t)) for t in loop),
            hmma=sum(n for o, n in ops.items() if o.startswith("HMMA")),
            unpack_lop3=sum(t.startswith("LOP3.LUT") and bool(re.search(r", 0xf000f0?, ", t))
                            for t in loop),
            hadd2=sum(n for o, n in ops.items() if o.startswith("HADD2") and "F32" not in o),
            lds=sum(n for o, n in ops.items() if o.startswith(("LDS", "LDSM"))),
            **ptxas_usage(log)))
    return out


def test_swap_kernels_compile_for_sm90():
    """On the CPU: "swap" builds for an H200 in bf16 and fp16 (the inline PTX assembles):
    its MMAs are wgmma with the weights from registers; the decode is what the PTX says,
    one lop3 (into OFFSET's mantissas) and one packed add (- OFFSET - z) a pair of weights
    a thread (a thread's share of a 64 x 128 tile: 32 pairs), fp16's loop shorter than
    bf16's (one shift a word, not three); unpipelined no
    shared-memory read at all in the loop (the word load's layout is wgmma's A fragment's:
    the decoded values never move between threads); nothing spills; and its K loop's SASS
    per weight and thread is under 0.4x "dot"'s at the same rows (the figures: -s prints
    them)."""
    from sm90 import run_compiled

    got = run_compiled("test_fused_moe_int4_swap", "_compile_int4_swap_kernels")
    for r in got:
        print({k: v for k, v in r.items()})
    assert len(got) == len(SASS_CASES)
    assert all(r["spill_bytes"] == 0 for r in got), got
    dot = {r["kernel"]: r["per_weight"] for r in got if r["form"] == "dot" and r["warps"] == 4}
    for r in got:
        if r["form"] != "swap":
            assert r["hmma"] > 0 and r["hgmma"] == 0, r  # "dot" at 16 rows: mma.sync
            continue
        tiles = 2 if r["kernel"] == "gate_up" else 1
        assert r["hgmma"] == 8 * tiles and r["hgmma_reg_a"] == r["hgmma"], r  # 128 / 16 a tile
        assert r["unpack_lop3"] == 32 * tiles and r["hadd2"] == 32 * tiles, r
        if r["stages"] == 1:
            assert r["lds"] == 0, r
        assert r["per_weight"] < 0.4 * dot[r["kernel"]], (r, dot)
    swap = {(r["kernel"], r["block_m"], r["stages"], r["dtype"]): r["loop"] for r in got
            if r["form"] == "swap"}
    for kern in ("gate_up", "down"):  # fp16's decode: 2 fewer shifts a word
        assert swap[kern, 16, 3, "fp16"] < swap[kern, 16, 3, "bf16"], swap


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("dtype", "asm"), [(torch.bfloat16, True), (torch.float16, True),
                                            (torch.bfloat16, False), (torch.float32, False)])
def test_word_decode_every_nibble_every_zero_gpu(dtype, asm):
    """The inline PTX (which nibble lands in which output, the halves of its registers) and
    the Triton decode compiled for the GPU: q - z of every nibble with every zero point."""
    assert_word_decode(dtype, asm)


def _qwen3_30b(t: int, seed: int, crowd: int):
    """Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, 128 experts, top-8),
    groups of 128 (the AWQ / GPTQ-Int4 checkpoints')."""
    gu = int4_experts(128, 2 * 768, 2048, 128, seed=seed)
    dn = int4_experts(128, 2048, 768, 128, seed=seed + 1)
    ids, w = routing(t, 8, 128, seed=seed + 2, crowd=crowd)
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(seed + 3)).to(DEV)
    return x, gu, dn, ids, w


GPU_TILES = [FusedMoEInt4Config(bm, bn, 128, 4, st, "swap")
             for bm, bn, st in ((16, 64, 3), (16, 64, 1), (32, 64, 1), (32, 64, 3), (16, 128, 3))]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "crowd"), [(1, 0), (8, 0), (16, 0), (64, 40), (256, 0)])
def test_swap_on_the_gpu_qwen3_30b(dtype, t, crowd):
    """bf16 / fp16 at Qwen3-30B-A3B's shape, every swap tile and the default: within 16-bit
    rounding (1% in norm) of the reference over the dequantized experts and of "dot"."""
    x, gu, dn, ids, w = _qwen3_30b(t, seed=t, crowd=crowd)
    x = x.to(dtype)
    want = fused_moe_int4_ref(x, *gu, *dn, ids, w)
    dot = fused_moe_int4(x, *gu, *dn, ids, w, FusedMoEInt4Config(block_m=16, block_k=64))
    assert _rel(dot, want) < 1e-2
    for cfg in (None, *GPU_TILES):
        got = fused_moe_int4(x, *gu, *dn, ids, w, cfg)
        assert torch.isfinite(got).all(), cfg
        assert _rel(got, want) < 1e-2 and _rel(got, dot) < 1e-2, cfg
