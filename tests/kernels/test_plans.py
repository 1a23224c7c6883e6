"""Plans (kernels/plan.py): paged_decode and paged_prefill planned once over a step's tables
and lengths, then run for each layer's own q, caches and out, as the unplanned calls give.

CPU (interpreter): fp32, two layers (two cache pairs) through one plan, splits (whose scratch
the layers share) and a wrong geometry refused. GPU (bf16): the Gluon decode and prefill
kernels (their TMA descriptors made once per cache, per plan) over three layers."""

from __future__ import annotations

import pytest
import torch
from test_flash_prefill import _ragged, _to_paged  # tests/kernels (on sys.path under pytest)
from test_paged_decode import make_case

from flashpage.kernels.flash_prefill import PrefillPlan, paged_prefill_ref
from flashpage.kernels.paged_decode import DecodePlan, paged_decode_ref
from flashpage.kernels.plan import LaunchPlan, planned

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output: a row unwritten or a key read past its context"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _decode_layers(seq_lens, hq, hkv, d, bs, dtype, layers):
    """Layers of one decode step: their own q and caches over one block table and lengths."""
    q, kc, vc, tables, lens = make_case(seq_lens, hq, hkv, d, bs, dtype, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)

    def other(t: torch.Tensor) -> torch.Tensor:  # new values, NaN where the first layer's are
        return (t.float() + torch.randn(t.shape, generator=g, device=DEV)).to(dtype)

    return [(q, kc, vc)] + [(other(q), other(kc), other(vc)) for _ in range(layers - 1)], tables, lens


@pytest.mark.parametrize("seq_lens,hq,hkv,splits", [
    ([1, 17, 40], 4, 4, None),  # the interpreter's 8 "SMs": splits chosen, their scratch shared
    ([33, 64, 5], 8, 2, 1),
    ([100, 1], 8, 1, 3),
])
def test_decode_plan_runs_each_layer_as_paged_decode(seq_lens, hq, hkv, splits):
    if GPU:
        pytest.skip("the GPU test below covers the GPU's kernels")
    layers, tables, lens = _decode_layers(seq_lens, hq, hkv, 64, 16, torch.float32, 3)
    q0, kc0, vc0 = layers[0]
    plan = DecodePlan(q0, kc0, vc0, tables, lens, num_splits=splits, out=torch.empty_like(q0))
    for q, kc, vc in layers:
        out = torch.full_like(q, float("nan"))
        assert plan.fits(q, kc, vc, out)
        assert plan.run(q, kc, vc, out) is out
        assert _rel(out, paged_decode_ref(q, kc, vc, tables, lens)) < 1e-5


def test_prefill_plan_runs_each_layer_as_paged_prefill():
    if GPU:
        pytest.skip("the GPU test below covers the GPU's kernels")
    layers = []
    for seed in range(3):
        q, k, v, cq, ck, mq, mk = _ragged([5, 37], [0, 20], 4, 2, 64, torch.float32, seed=seed)
        kc, vc, tables, lens = _to_paged(k, v, ck, 16)  # the same shuffle: one block table
        layers.append((q, kc, vc))
    plan = PrefillPlan(*layers[0], tables, cq, lens, mq, mk)
    for q, kc, vc in layers:
        out = plan.run(q, kc, vc)
        ref = paged_prefill_ref(q, kc, vc, tables, cq, lens, mq, mk)
        assert _rel(out, ref) < 2e-5


def test_a_plan_refuses_another_geometry_and_planned_plans_again():
    if GPU:
        pytest.skip("CPU bookkeeping")
    layers, tables, lens = _decode_layers([9, 30], 4, 2, 64, 16, torch.float32, 1)
    q, kc, vc = layers[0]
    plan = DecodePlan(q, kc, vc, tables, lens)
    assert not plan.fits(q.half(), kc, vc)
    assert not plan.fits(q[:1], kc, vc)
    assert not plan.fits(q, kc[:-1], vc[:-1])
    with pytest.raises(ValueError, match="DecodePlan.run: q, the caches or out differ"):
        plan.run(q, kc, vc, torch.empty(2, 4, 64, dtype=torch.float16))
    made: list[LaunchPlan] = []

    def make() -> LaunchPlan:
        made.append(DecodePlan(q, kc, vc, tables, lens, out=out))
        return made[-1]

    plans: dict = {}
    out = torch.empty_like(q)
    for _ in range(3):  # three layers: planned by the first
        planned(plans, "decode", make, q, kc, vc, out)
    assert len(made) == 1 and plans["decode"] is made[0]
    narrow = torch.empty(2, 4, 64)[:, :, :64]  # the same geometry again: no new plan
    planned(plans, "decode", make, q, kc, vc, narrow)
    assert len(made) == 1
    other = torch.empty(2, 4, 128)[:, :, :64]  # strided differently: planned again
    planned(plans, "decode", make, q, kc, vc, other)
    assert len(made) == 2
    assert _rel(other, paged_decode_ref(q, kc, vc, tables, lens)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_plans_gpu_bf16_gluon():
    """bf16, head_dim 128, block 16 on sm_90: the Gluon kernels, three layers a plan."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are sm_90's")
    layers, tables, lens = _decode_layers([1, 300, 77, 1024] * 8, 32, 8, 128, 16, torch.bfloat16, 3)
    plan = DecodePlan(*layers[0], tables, lens)
    for q, kc, vc in layers:
        assert _rel(plan.run(q, kc, vc), paged_decode_ref(q, kc, vc, tables, lens)) < 1.2e-2
    pre = []
    for seed in range(3):
        q, k, v, cq, ck, mq, mk = _ragged([128, 7, 300], [0, 50, 900], 32, 8, 128, torch.bfloat16, seed=seed)
        kc, vc, ptables, plens = _to_paged(k, v, ck, 16)
        pre.append((q, kc, vc))
    pplan = PrefillPlan(*pre[0], ptables, cq, plens, mq, mk)
    for q, kc, vc in pre:
        ref = paged_prefill_ref(q, kc, vc, ptables, cq, plens, mq, mk)
        assert _rel(pplan.run(q, kc, vc), ref) < 1.6e-2
    # the plan holds no layer's q but the last one's (an eager step's peak memory)
    import weakref

    qs = [q.clone() for q, _, _ in pre]
    refs = [weakref.ref(q) for q in qs]
    for q, (_, kc, vc) in zip(qs, pre, strict=True):
        pplan.run(q, kc, vc)
    del q, qs
    assert [r() is None for r in refs] == [True, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_a_capture_plans_apart_from_its_warm_up():
    """A capture's warm-up plans first; inside the capture a plan of its own is made, so that
    the split scratch the graph writes comes from the graph's pool (the warm-up plan's,
    freed with it, was reused memory by the time an 8B engine replayed its decode graphs)."""
    layers, tables, lens = _decode_layers([2000, 7], 8, 1, 128, 16, torch.bfloat16, 1)
    q, kc, vc = layers[0]
    out = torch.empty_like(q)
    plans: dict = {}

    def make() -> LaunchPlan:
        return DecodePlan(q, kc, vc, tables, lens, out=out)

    planned(plans, "decode", make, q, kc, vc, out)  # the warm-up run
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planned(plans, "decode", make, q, kc, vc, out)
    assert set(plans) == {"decode", ("decode", "captured")}
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, paged_decode_ref(q, kc, vc, tables, lens)) < 1.2e-2


def test_descriptor_memo_keys_on_the_tensor_geometry():
    from flashpage.kernels.tma_maps import descriptor

    memo: dict = {}
    made = []

    def make(t):
        made.append(t)
        return object()

    cache = torch.zeros(4, 16, 2, 64)
    first = descriptor(memo, "k", cache, make)
    assert descriptor(memo, "k", cache, make) is first and len(made) == 1
    assert descriptor(memo, "v", cache, make) is not first  # another kernel's kind
    assert descriptor(memo, "k", cache[:2], make) is not first  # same address, another shape
    assert len(made) == 3
