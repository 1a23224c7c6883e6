"""Kernels compiled for sm_90 on a machine without a GPU (Triton ships ptxas), for the
tests that read their PTX: one signature builder, one subprocess runner.

``compile_sm90`` refuses a kernel whose ``tl.constexpr`` parameters are not all given: a
missing one would otherwise enter the signature as a runtime int and fail far from the
cause (or compile a kernel other than the one meant).
"""

from __future__ import annotations

import json
import os
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
