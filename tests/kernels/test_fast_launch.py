"""kernels/fast_launch.py: a JIT kernel launched through its compiled form after its first
launch. CPU: the key (what each argument contributes), the dispatch over a stand-in kernel
(first launch through the JIT, later ones to the compiled kernel with every parameter
positionally, a new key or FLASHPAGE_FAST_LAUNCH=0 through the JIT again). GPU (sm_90): the
Gluon prefill, contiguous and paged, bit for bit the same through either path, over inputs
whose alignment and integer arguments change between calls, and under CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.fast_launch import FastLauncher, arg_key

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_arg_key_covers_what_triton_specializes():
    t = torch.zeros(16, dtype=torch.float16)
    assert arg_key(t) == (torch.float16, True)
    assert arg_key(t[1:]) == (torch.float16, False)  # 2 bytes past a 16-byte boundary
    assert arg_key(t.to(torch.float32)) != arg_key(t)
    assert len({arg_key(1), arg_key(17), arg_key(32), arg_key(2**31), arg_key(-16)}) == 5
    assert arg_key(16) == arg_key(48) and arg_key(5) == arg_key(7)
    assert arg_key(True) != arg_key(1)
    assert arg_key(0.5) == arg_key(2.0) == "f"

    class Desc:  # a host TMA descriptor's fields
        def __init__(self, base, block):
            self.base, self.block_shape, self.layout, self.padding = base, block, "swizzle128", "zero"

    assert arg_key(Desc(t, [16, 128])) != arg_key(Desc(t, [64, 128]))
    with pytest.raises(TypeError, match="no key"):
        arg_key(object())


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("compiled", grid, args))


class _Kernel:
    """Stands in for a JIT function: kernel[grid](*args, **kw) 'compiles', launches, returns
    the compiled kernel."""
    arg_names = ["a_ptr", "n", "scale", "BLOCK", "EVEN"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return _Compiled(self.log)
        return run


def test_fast_launcher_dispatch(monkeypatch):
    monkeypatch.delenv("FLASHPAGE_FAST_LAUNCH", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _Kernel()
    launch = FastLauncher(k)
    buf = torch.zeros(64, dtype=torch.float32)
    consts, opts = {"BLOCK": 64, "EVEN": True}, {"num_warps": 4}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launch((3,), (buf, 100, 0.5), consts, opts)
    launch((5,), (buf, 100, 0.25), consts, opts)  # same key: compiled, constexprs positional
    launch((5, 2), (buf, 116, 0.25), consts, opts)  # 116 % 16 == 4 as 100's: same key
    assert [e[0] for e in k.log] == ["jit", "compiled", "compiled"]
    assert k.log[0] == ("jit", (3,), (buf, 100, 0.5), {"BLOCK": 64, "EVEN": True, "num_warps": 4})
    assert k.log[1] == ("compiled", (5, 1, 1), (buf, 100, 0.25, 64, True))
    assert k.log[2][1] == (5, 2, 1)
    launch((1,), (buf[1:], 100, 0.5), consts, opts)  # unaligned pointer: a new key
    launch((1,), (buf, 1, 0.5), consts, opts)  # n == 1: a new key
    launch((1,), (buf, 100, 0.5), {"BLOCK": 32, "EVEN": True}, opts)  # another constexpr
    launch((1,), (buf, 100, 0.5), consts, {"num_warps": 8})  # another option
    assert [e[0] for e in k.log[3:]] == ["jit"] * 4 and launch.jit_launches == 5
    launch((1,), (buf[1:], 100, 0.5), consts, opts)
    assert k.log[-1][0] == "compiled"
    monkeypatch.setenv("FLASHPAGE_FAST_LAUNCH", "0")
    launch((1,), (buf, 100, 0.5), consts, opts)
    assert k.log[-1][0] == "jit"
    monkeypatch.setenv("FLASHPAGE_FAST_LAUNCH", "1")
    for bad in ({"EVEN": True, "BLOCK": 64}, {"BLOCK": 64}):  # out of order; one left to its default
        other = FastLauncher(_Kernel())
        for _ in range(2):
            other((1,), (buf, 100, 0.5), bad, opts)
        assert other.jit_launches == 2 and not other.compiled
    odd = FastLauncher(_Kernel())  # an argument arg_key does not know: the JIT, never cached
    for _ in range(2):
        odd((1,), (buf, 100, object()), consts, opts)
    assert odd.jit_launches == 2 and not odd.compiled
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: always the JIT
    launch((1,), (buf, 100, 0.5), consts, opts)
    assert k.log[-1][0] == "jit"


def test_bound_launches_call_the_compiled_kernel(monkeypatch):
    """bind: the first launch as a call makes it; later ones straight to the compiled kernel
    for new tensors at the varying positions, a call's dispatch where their alignment
    changes; the interpreter and FLASHPAGE_FAST_LAUNCH=0 always through the JIT."""
    monkeypatch.delenv("FLASHPAGE_FAST_LAUNCH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _Kernel()
    launcher = FastLauncher(k)
    a, b = torch.zeros(64), torch.ones(64)
    consts, opts = {"BLOCK": 64, "EVEN": True}, {"num_warps": 4}
    launch = launcher.bind((3,), (a, 100, 0.5), consts, opts, varying=(0,))
    assert [e[0] for e in k.log] == ["jit"]
    launch((b, 100, 0.5))
    assert k.log[-1] == ("compiled", (3, 1, 1), (b, 100, 0.5, 64, True))
    launch((b[1:], 100, 0.5))  # misaligned: the full dispatch (a new key, through the JIT)
    assert k.log[-1][0] == "jit" and launcher.jit_launches == 2
    launch((a, 100, 0.5))
    assert k.log[-1][0] == "compiled"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = launcher.bind((3,), (a, 100, 0.5), consts, opts, varying=(0,))
    interpreted((b, 100, 0.5))
    assert [e[0] for e in k.log[-2:]] == ["jit", "jit"]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gluon_prefill_fast_launch_matches_jit(monkeypatch):
    """The Gluon prefill through the compiled kernel and through the JIT: bit for bit the same,
    contiguous and paged, as the inputs' sizes, slice offsets (alignment) and lse change from
    call to call; a CUDA graph captured on the fast path replays right."""
    from test_flash_prefill_gluon import _paged_case, _ragged

    from flashpage.kernels import flash_prefill_gluon as fg

    def both(fn):
        monkeypatch.setenv("FLASHPAGE_FAST_LAUNCH", "0")
        slow = fn()
        monkeypatch.setenv("FLASHPAGE_FAST_LAUNCH", "1")
        fast1, fast2 = fn(), fn()  # the second from the compiled kernel
        torch.cuda.synchronize()
        for a, b in ((slow, fast1), (slow, fast2)):
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
                assert torch.equal(x, y)

    for lens, lse in (([700, 1, 129], False), ([5, 300], True), ([64], False)):
        q, k, v, cu = _ragged(lens, 8, 2, seed=len(lens))
        both(lambda q=q, k=k, v=v, cu=cu, m=max(lens), lse=lse: fg.flash_prefill_gluon(q, k, v, cu, m, return_lse=lse))
    for nd, (q_lens, prefixes) in enumerate((([300, 5], [100, 2000]), ([1], [33]), ([17, 9, 3], [0, 40, 7]))):
        case = list(_paged_case(q_lens, prefixes, 8, 2, 16, seed=nd))
        lens = torch.empty(len(q_lens) + nd, dtype=torch.int32, device="cuda")[nd:]  # the engine's [nd:] views
        lens.copy_(case[5])
        case[5] = lens
        both(lambda c=tuple(case): fg.paged_prefill_gluon(*c, **fg.engine_options(16)))
    q, k, v, cu = _ragged([200, 77], 8, 2, seed=9)
    ref = fg.flash_prefill_gluon(q, k, v, cu, 200)
    out = torch.empty_like(q)
    fg.flash_prefill_gluon(q, k, v, cu, 200, out=out)  # the fast path's compiled kernel exists
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fg.flash_prefill_gluon(q, k, v, cu, 200, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_fast_launch_matches_jit(monkeypatch, dtype):
    """The Triton paged decode and its split merge through the compiled kernels and through
    the JIT: bit for bit the same over splits (merge kernel and fused merge), PDL on and off,
    batches and tables that change from call to call."""
    from test_paged_decode import make_case

    from flashpage.kernels import paged_decode as pd

    configs = [pd.DecodeConfig(64, 4, 3), pd.DecodeConfig(64, 4, 3, fused_merge=True),
               pd.DecodeConfig(64, 4, 2, heads_fastest=True)]
    for i, (lens, splits, pdl) in enumerate((([300, 1, 77], 4, True), ([2000], 9, False),
                                             ([5, 900, 64, 33], 1, True), ([129, 16], 3, False))):
        case = make_case(lens, 8, 2, 128, 16, dtype, device="cuda", seed=i)
        for cfg in configs:
            def run(c=case, cfg=cfg, splits=splits, pdl=pdl):
                return pd._launch(*c, sm_scale=None, window_size=None, out=None, num_splits=splits,
                                  config=cfg, pdl=pdl)
            monkeypatch.setenv("FLASHPAGE_FAST_LAUNCH", "0")
            slow = run()
            monkeypatch.setenv("FLASHPAGE_FAST_LAUNCH", "1")
            fast1, fast2 = run(), run()  # the second from the compiled kernels
            torch.cuda.synchronize()
            assert torch.equal(slow, fast1) and torch.equal(slow, fast2), (lens, splits, cfg)
    assert pd._DECODE_LAUNCH.compiled and pd._MERGE_LAUNCH.compiled
