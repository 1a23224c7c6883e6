"""Arguments that change from one engine step to the next must not be specialized on.

Triton compiles a kernel again for every new combination of "is 1 / divisible by 16" of its
integer arguments. Work-item and split counts follow the batch, so a kernel that
specializes on them compiles inside the first users' requests, after the warm-up. (The
block-table row stride is the other per-step integer: the engine pads the width to a
multiple of 16 instead, model_runner._table_width, test_warm_up.py.) A Gluon decode kernel
compiled twice in the timed run of H200 run 84 (1.1-1.2 s prompt steps, 8B fp8 10.5k
instead of 12.3k tok/s in a machine's first process).
"""
import importlib
import inspect
import pkgutil

import pytest
import triton
from triton.runtime.interpreter import InterpretedFunction

import flashpage.kernels

PER_STEP = {"num_items", "num_splits"}


def _jit_kernels():
    for info in pkgutil.iter_modules(flashpage.kernels.__path__):
        try:
            mod = importlib.import_module(f"flashpage.kernels.{info.name}")
        except ImportError:  # a kernel module needing what this machine lacks
            continue
        for name, obj in vars(mod).items():
            # launched kernels only: a helper called from one is inlined, taking the
            # caller's specialization
            if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)) and getattr(obj, "fn", obj).__module__ == mod.__name__ \
                    and name.endswith("_kernel"):
                yield f"{info.name}.{name}", obj


KERNELS = dict(_jit_kernels())


def test_found_the_kernels():
    names = set(KERNELS)
    for expected in ("paged_decode._paged_decode_kernel", "paged_decode_gluon._paged_decode_gluon_persistent_kernel",
                     "paged_decode_gluon_bf16._paged_decode_gluon16_kernel", "mla_decode_gluon._mla_decode_gluon_kernel"):
        assert expected in names


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_per_step_arguments_not_specialized(name):
    fn = KERNELS[name]
    if isinstance(fn, InterpretedFunction):  # TRITON_INTERPRET=1: the decorator's arguments
        args, spared = fn.arg_names, set(fn.kwargs.get("do_not_specialize") or ())
        constexprs = {a for a, p in inspect.signature(fn.fn).parameters.items()
                      if "constexpr" in str(p.annotation)}
    else:
        args, spared = fn.arg_names, {p.name for p in fn.params if p.do_not_specialize}
        constexprs = {p.name for p in fn.params if p.is_constexpr}
    wrong = sorted((PER_STEP & set(args)) - spared - constexprs)
    assert not wrong, f"{name} specializes on {wrong}: add them to do_not_specialize"
