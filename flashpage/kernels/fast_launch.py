"""A JIT kernel launched straight through its compiled form after its first launch.

Triton 3.6's ``kernel[grid](*args, **constexprs)`` does, on every call, the work of finding
the compiled kernel: it binds the arguments, specializes each (dtype, 16-byte alignment,
ints equal to 1 or divisible by 16), hashes a cache key, and compares every module global
the kernel read against its value at compile time (the Gluon prefill reads 14 constexpr
globals). Skipping it took the Gluon prefill's host time a call from 187-299 to 148-241 us on
H200 hosts (runs 119-120, benchmarks/launch_overhead.py; our Triton paged prefill's whole call
is 73-120 us there), and prompt steps run eagerly, each layer launching it, RMSNorm, rotary and
SiLU-mul: an 8B 128-token prompt's first token 32.6 -> 26.7 ms (run 123).

``FastLauncher(kernel)(grid, args, constexprs, options)`` launches as ``kernel[grid](*args,
**constexprs, **options)`` would, the first time through exactly that (which compiles or
loads the kernel and launches it); after that it keeps the compiled kernel under a key that
holds every constexpr and option value and, for every positional argument, a superset of
what Triton specializes on (a tensor's dtype and 16-byte alignment; an int's == 1, % 16 and
32-bit range; a TMA descriptor's dtype, block shape, layout and padding), and launches the
compiled kernel directly (CompiledKernel[grid]: the current stream, launch hooks honoured;
a CUDA graph captures it as usual). A call whose key is new goes through the JIT once more.
Not checked on the fast path: module globals changed after the first launch (ours are
constants). The constexprs must be passed by keyword, all of them, in signature order, after
every other parameter positionally (else every launch goes through the JIT). Under the
interpreter (TRITON_INTERPRET=1) and with FLASHPAGE_FAST_LAUNCH=0 every launch goes through
the JIT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashpage import envs
from flashpage.kernels.device import interpreting


def arg_key(a: Any) -> Any:
    """What a positional kernel argument contributes to the compiled-kernel key: at least
    everything Triton's specialization reads from it."""
    t = type(a)
    if t is int:
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 0)
    if t is float:
        return "f"
    if t is bool:
        return ("b", a)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None:
        return None
    if hasattr(a, "block_shape") and hasattr(a, "base"):  # a host TMA descriptor
        return ("d", a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None))
    raise TypeError(f"fast_launch: no key for a kernel argument of type {t.__name__}")


class FastLauncher:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # every parameter in signature order: the compiled kernel takes them all positionally,
        # constexprs included (as the JIT passes them)
        self.params = list(getattr(kernel, "arg_names", ()))
        self.compiled: dict[tuple, Any] = {}
        self.jit_launches = 0  # launches that went through the JIT (tests)

    def _jit(self, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict) -> Any:
        """Triton's own dispatch (compiles or finds the kernel, launches it) -> the compiled kernel."""
        self.jit_launches += 1
        return self.kernel[grid](*args, **constexprs, **options)

    @staticmethod
    def _key(args: tuple, constexprs: dict, options: dict) -> tuple | None:
        try:
            return (torch.cuda.current_device(), tuple(constexprs.items()), tuple(options.items()),
                    tuple(arg_key(a) for a in args))
        except TypeError:  # an argument of a kind arg_key does not know: Triton's own dispatch
            return None

    def bind(self, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict,
             varying: tuple[int, ...]) -> Callable[[tuple], None]:
        """Launch now, as a call would -> launch(args) for later launches on this grid whose
        arguments have these arguments' keys (arg_key: the same dtypes, integer classes and
        descriptor geometry; the caller's promise, as a plan's layers keep it: their own q,
        caches and out, kernels/plan.py) but for the alignment of the tensors at ``varying``.
        Those launches call the compiled kernel straight, with no key made, while the
        ``varying`` tensors keep this call's 16-byte alignment (else a call's full dispatch)."""
        self(grid, args, constexprs, options)
        key = None if not envs.fast_launch() or interpreting() else self._key(args, constexprs, options)
        compiled = self.compiled.get(key) if key is not None else None
        if compiled is None:
            return lambda a: self(grid, a, constexprs, options)
        run, consts = compiled[(*grid, 1, 1)[:3]], tuple(constexprs.values())
        aligned = tuple(args[i].data_ptr() % 16 == 0 for i in varying)

        def launch(a: tuple) -> None:
            if tuple(a[i].data_ptr() % 16 == 0 for i in varying) == aligned:
                run(*a, *consts)
            else:
                self(grid, a, constexprs, options)

        return launch

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict) -> None:
        if not envs.fast_launch() or interpreting():
            self._jit(grid, args, constexprs, options)
            return
        key = self._key(args, constexprs, options)
        if key is None:
            self._jit(grid, args, constexprs, options)
            return
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self._jit(grid, args, constexprs, options)
            # only where the constexprs are exactly the parameters after the positional ones
            # (a constexpr left to its default would be missing from the positional call)
            if compiled is not None and self.params[len(args):] == list(constexprs):
                self.compiled[key] = compiled
            return
        compiled[(*grid, 1, 1)[:3]](*args, *constexprs.values())
