"""Kernels compiled for sm_90 on a machine without a GPU (Triton ships ptxas), for the
tests that read their PTX: one signature builder, one subprocess runner, and the readers of
ptxas's log and of the SASS listing.

``compile_sm90`` refuses a kernel whose ``tl.constexpr`` parameters are not all given: a
missing one would otherwise enter the signature as a runtime int and fail far from the
cause (or compile a kernel other than the one meant).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def compile_sm90(fn, consts: dict, types: dict[str, str], *, num_warps: int, num_stages: int,
                 aligned=(), **options):
    """``fn`` compiled for sm_90 with ``consts`` (every constexpr parameter) and ``types``
    (argument -> Triton type; otherwise ``*bf16`` for names ending in ``_ptr``, ``i32``).
    ``aligned``: arguments marked divisible by 16, as a GPU launch specializes pointers
    and such strides (without the hints the address arithmetic, registers and spills
    differ from what the GPU runs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr parameter(s) {missing}")
    sig = {a: "constexpr" if a in consts else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
           for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def run_compiled(module: str, func: str):
    """``module.func()`` (a module of this folder) run with the interpreter off, in a
    subprocess, its result passed back as JSON; skips where Triton has no ptxas."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import {module}; "
            f"print(json.dumps({module}.{func}()))")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ reading what ptxas made


def ptxas_sm90a(ptx: str) -> tuple[str, str]:
    """(ptxas -v's log, nvdisasm's SASS listing) of ``ptx`` built for sm_90a with the tools
    Triton ships."""
    import tempfile

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        log = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"],
                             cwd=tmp, capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", "k.cubin"], cwd=tmp,
                              capture_output=True, text=True, check=True).stdout
    return log, sass


def ptxas_usage(log: str) -> dict:
    """Registers per thread and bytes spilled (stores + loads), from ptxas -v's log."""
    regs = int(re.search(r"Used (\d+) registers", log)[1])
    return dict(regs=regs, spill_bytes=sum(int(x) for x in re.findall(r"(\d+) bytes spill", log)))


def sass_instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """The SASS instructions of an nvdisasm listing (a leading predicate dropped) and each
    label's index."""
    ins, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m[1]] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line):
            ins.append(re.sub(r"^@!?U?P\w+\s+", "", m[1]))
    return ins, labels


def sass_loops(ins: list[str], labels: dict[str, int], end: int | None = None) -> list[tuple[int, int]]:
    """(first, last) instruction index of every loop: a branch back to a label before it
    (among the first ``end`` instructions)."""
    return [(labels[m[1]], i) for i, t in enumerate(ins[:end])
            if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)) and labels.get(m[1], i + 1) <= i]


def tma_mma_loop_mix(sass: str) -> dict[str, int]:
    """Opcode counts (modifiers kept: ``LDS.128``, ``LDSM.16.MT88.4``) of a TMA-fed kernel's main
    loop: the shortest backward-branch span holding both a TMA issue and an HMMA; "total" its
    length."""
    ins, labels = sass_instructions(sass)
    bodies = [[t.split(" ")[0] for t in ins[lo:hi + 1]] for lo, hi in sass_loops(ins, labels)]
    body = min((b for b in bodies if any(o.startswith("UTMALDG") for o in b) and any(o.startswith("HMMA") for o in b)),
               key=len)
    mix = collections.Counter(body)
    mix["total"] = len(body)
    return dict(mix)


def register_budgets(ins: list[str]) -> list[int | None]:
    """Each instruction's register budget: that of the last USETMAXREG before it (the
    partitions of a warp-specialized kernel start with one), None before any."""
    budget, cur = [], None
    for t in ins:
        if m := re.match(r"USETMAXREG\.\S+\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)", t):
            cur = int(m[1], 16)
        budget.append(cur)
    return budget


def registers_used(ins: list[str], budget: list[int | None]) -> dict[str, int]:
    """The highest register (+ 1) used under each budget."""
    top: dict = collections.defaultdict(int)
    for b, t in zip(budget, ins, strict=True):
        for r in re.findall(r"\bR(\d+)\b", t):
            top[b] = max(top[b], int(r) + 1)
    return {str(b): n for b, n in top.items() if b}


# SASS instructions that write no general register (their first operand is read, or none)
_NO_REG_DEST = ("HGMMA", "ST", "BRA", "WARPGROUP", "BAR", "DEPBAR", "LDGDEPBAR", "SYNCS", "UTMA",
                "LDGSTS", "RED", "ATOM", "NOP", "EXIT", "WARPSYNC", "FENCE", "ISETP", "FSETP",
                "HSETP", "PLOP3", "R2UR", "U")


def _written_registers(t: str) -> set[int]:
    """The general registers a SASS instruction writes (its destination: 1, 2 for a 64-bit
    and 4 for a 128-bit result); none for a store, branch, barrier or uniform op."""
    op = t.split(" ")[0]
    m = re.match(r"\S+\s+R(\d+)\b", t)
    if op.startswith(_NO_REG_DEST) or not m:
        return set()
    n = 4 if ".128" in op else 2 if (".64" in op or op.startswith("IMAD.WIDE")) else 1
    return set(range(int(m[1]), int(m[1]) + n))


def wgmma_a_clobbers(loop: list[str]) -> list[str]:
    """The instructions of a K loop's SASS (its body, run twice: one trip into the next)
    that write a register holding the A fragment of a warpgroup MMA still in flight (issued,
    not yet retired by a ``WARPGROUP.DEPBAR.LE gsb0, n``): the MMA may read its registers
    after, so it would multiply what they were overwritten with."""
    flight: list[tuple[int, set[int]]] = []
    hits = []
    for trip in range(2):
        for i, t in enumerate(loop):
            if m := re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", t):
                del flight[:max(0, len(flight) - int(m[1], 16))]
                continue
            written = _written_registers(t)
            hits += [f"{t} (HGMMA #{j}'s A)" for j, regs in flight if trip and written & regs]
            if a := re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", t):
                flight.append((i, set(range(int(a[1]), int(a[1]) + 4))))
    return hits
