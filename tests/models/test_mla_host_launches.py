"""What MLA's attention launches per layer on the triton backend (the host time of
DeepSeek-V2-Lite's piecewise steps): the prompt path's latents expanded by
kernels/mla_expand.py's two planned kernels, equal bit for bit to the torch path's
expansion; the planned decode's split merge launched through its FastLauncher, bound
once a step.

CPU (Triton interpreter, fp32, a tiny DeepSeek-V2 checkpoint): a prompt-only step, then a
mixed step (two decodes with a split merge, a prompt chunk over a cached prefix), each run
with the backend's expansion and with the torch one. Launches are counted per layer in
``attend``: every aten op that is no view or allocation (what launches a kernel on the
GPU) and every Triton grid the interpreter runs.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashpage.attention.triton import TritonBackend
from flashpage.layers.mla_attention import MLAAttention
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import random_prompts, step_metadata

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")

aten = torch.ops.aten
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
             aten.new_empty_strided.default}


class LaunchCounter(TorchDispatchMode):
    """Kernel launches: aten ops that are no view or allocation, and Triton grids."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.in_grid = False  # the interpreter's own tensor copies while it runs a grid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_grid and not func.is_view and func not in NO_KERNEL:
            self.launches[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """Launches inside MLAAttention.attend, per kind, over every layer of the runs made."""
    from triton.runtime import interpreter

    counter = LaunchCounter()
    inside = [False]
    real_grid = interpreter.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        if not inside[0]:
            return real_grid(self, *args, **kwargs)
        counter.launches[f"triton.{self.fn.__name__}"] += 1
        counter.in_grid = True
        try:
            return real_grid(self, *args, **kwargs)
        finally:
            counter.in_grid = False

    real_attend = MLAAttention.attend

    def attend(self, *args, **kwargs):
        inside[0] = True
        try:
            with counter:
                return real_attend(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", grid_call)
    monkeypatch.setattr(MLAAttention, "attend", attend)
    return counter


BLOCK = 16
WIDTH = 40  # block-table width: a decode's 640-key bound gives the CPU's split heuristic 2 splits


def _model(tiny_mla_checkpoint):
    source = resolve_model(str(tiny_mla_checkpoint("deepseek_v2")))
    model = load_model(source, torch.float32, torch.device("cpu"))
    backend = TritonBackend(source.config, torch.device("cpu"), torch.float32)
    for layer in model.attention_layers():
        layer.kv_cache = torch.full(layer.kv_cache_shape(3 * WIDTH, BLOCK), float("nan"))
        layer.backend = backend
    return model, backend, source.config


def _run(model, backend, tokens, q_lens, seq_lens, tables, num_decodes, counter=None):
    md, pos = step_metadata(q_lens, seq_lens, [t + [0] * (WIDTH - len(t)) for t in tables], BLOCK,
                            num_decodes)
    backend.prepare(md)
    with torch.no_grad():
        if counter is not None:
            counter.launches.clear()
        return model(torch.tensor(tokens), pos, md)


def _per_layer(counter, layers: int) -> dict[str, int]:
    assert all(v % layers == 0 for v in counter.launches.values()), counter.launches
    return {k: v // layers for k, v in sorted(counter.launches.items())}


def test_expansion_kernels_match_torch_path_and_launch_less(tiny_mla_checkpoint, counted,
                                                            monkeypatch):
    model, backend, cfg = _model(tiny_mla_checkpoint)
    layers = cfg.num_hidden_layers
    perm = torch.randperm(3 * WIDTH, generator=torch.Generator().manual_seed(2)).tolist()
    tables = [perm[:3], perm[3:6], perm[6:9]]  # scattered pages
    lens = [40, 9, 33]
    prompts = [random_prompts(1, n, n, seed=30 + i)[0] for i, n in enumerate(lens)]

    counts, outs = {}, {}
    for path in ("kernels", "torch"):
        if path == "torch":  # the layer's torch expansion (mla_expand_prefill_torch)
            monkeypatch.setattr(backend, "expand_mla_prefill", None, raising=False)
        # a prompt-only step: two prompts
        outs[path, "prompt"] = _run(model, backend, prompts[0] + prompts[1], lens[:2], lens[:2],
                                    tables[:2], 0, counted)
        counts[path, "prompt"] = _per_layer(counted, layers)
        # a mixed step: both requests decode one token, the third prompt's last 17 tokens run
        # over its first 16 (a prefix hit: its prompt pages were written by an earlier step)
        _run(model, backend, prompts[2][:16], [16], [16], tables[2:], 0)
        outs[path, "mixed"] = _run(model, backend, [5, 6] + prompts[2][16:],
                                   [1, 1, 17], [41, 10, 33], tables, 2, counted)
        counts[path, "mixed"] = _per_layer(counted, layers)

    for step in ("prompt", "mixed"):
        assert torch.isfinite(outs["kernels", step]).all()
        assert torch.equal(outs["kernels", step], outs["torch", step]), step

    # The expansion: one gather, the matmul, one copy kernel, whatever the request count;
    # the torch path an int64 cast and an index_select per request, a cat of the requests,
    # the matmul, two cats (K, q) and V's copy.
    expand_k = {"triton._gather_latents_kernel": 1, "aten.mm": 1, "triton._expand_kernel": 1}
    for step, requests in (("prompt", 2), ("mixed", 1)):
        k, t = counts["kernels", step], counts["torch", step]
        assert all(k[name] == n for name, n in expand_k.items()), k
        assert "aten.index_select" not in k, k
        assert t.get("aten.index_select") == requests and "triton._expand_kernel" not in t, t
        assert sum(k.values()) < sum(t.values()), (k, t)
    # a prompt-only step returns the prefill's output, a mixed step's prefill writes its rows
    # of the layer's output in place: the one copy left is the decodes' (their W_UV bmm)
    assert "aten.copy_" not in counts["kernels", "prompt"], counts["kernels", "prompt"]
    assert counts["kernels", "mixed"]["aten.copy_"] == 1, counts["kernels", "mixed"]
    # per layer: gather, mm, expand, prefill; and the decodes' bmm, cat, decode, merge, bmm,
    # copy (before this change: 11 and 14, the torch path's expansion and two output copies)
    assert sum(counts["kernels", "prompt"].values()) == 4
    assert sum(counts["kernels", "mixed"].values()) == 10
    assert counts["torch", "prompt"]["aten.cat"] == 3  # the requests, K, q
    assert counts["kernels", "prompt"].get("aten.cat", 0) == 0
    print({f"{p}/{s}": (sum(c.values()), c) for (p, s), c in counts.items()})


def test_planned_decode_merge_goes_through_fast_launcher(tiny_mla_checkpoint, monkeypatch):
    """A decode step's split merge: bound (FastLauncher.bind) by the step's first layer,
    every later layer launching the bound form; no merge launched around the launcher."""
    from triton.runtime import interpreter

    import flashpage.kernels.mla_decode as mod
    from flashpage.kernels.fast_launch import FastLauncher

    class Spy(FastLauncher):
        def __init__(self, kernel) -> None:
            super().__init__(kernel)
            self.binds = self.bound_launches = self.calls = 0

        def bind(self, grid, args, consts, options, varying):
            self.binds += 1
            inner = super().bind(grid, args, consts, options, varying)

            def launch(a):
                self.bound_launches += 1
                inner(a)

            return launch

        def __call__(self, grid, args, consts, options):
            self.calls += 1
            super().__call__(grid, args, consts, options)

    spy = Spy(mod._mla_merge_kernel)
    monkeypatch.setattr(mod, "_MERGE_LAUNCH", spy)
    merges = []
    real_grid = interpreter.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        if self.fn.__name__ == "_mla_merge_kernel":
            merges.append(1)
        return real_grid(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", grid_call)
    model, backend, cfg = _model(tiny_mla_checkpoint)
    layers = cfg.num_hidden_layers
    lens = [30, 21]
    tables = [[0, 1], [2, 3]]
    prompts = [random_prompts(1, n, n, seed=40 + i)[0] for i, n in enumerate(lens)]
    _run(model, backend, prompts[0] + prompts[1], lens, lens, tables, 0)
    assert spy.binds == 0 and not merges  # a prompt step has no decode
    md_steps = 2
    for step in range(md_steps):
        _run(model, backend, [7, 8], [1, 1], [n + 1 + step for n in lens], tables, 2)
    # each step planned once (its first layer binds), the other layers launch the bound merge
    assert spy.binds == md_steps, spy.binds
    assert spy.bound_launches == md_steps * (layers - 1)
    assert spy.calls == len(merges) == md_steps * layers  # every merge through the launcher
