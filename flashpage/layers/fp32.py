"""A mixin for modules whose tensors must stay fp32 whatever the model dtype."""

from __future__ import annotations

import torch


class KeepFp32:
    """Keep this module's own parameters and buffers in fp32 through ``model.to(dtype)``.

    For tensors whose precision matters more than their size: the MoE router (routing
    picks among near-equal scores; transformers keeps it fp32 too) and rotary cos/sin
    caches (a bf16 round trip would lose most of their bits).
    """

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # detach(): keeps the old storage even when ``param.data`` is swapped in place.
        before = {n: t.detach() for n, t in [*self._parameters.items(), *self._buffers.items()]
                  if t is not None}
        super()._apply(fn, recurse)  # type: ignore[misc]
        for name, old in before.items():
            new = getattr(self, name)
            if new.dtype != torch.float32 and new.is_floating_point():
                # Move only: converting back from the cast copy would lose precision.
                new.data = old.to(device=new.device, dtype=torch.float32)
        return self
