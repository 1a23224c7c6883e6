from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into
    Python ints with int(array), which numpy >= 2.4 refuses for arrays with ndim > 0.
    Loops with data-dependent bounds (``range(start, end)`` of loaded values) then fail
    on the CPU. Take the single element instead."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


_fix_interpreter_scalar_index()
