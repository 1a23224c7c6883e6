"""L2 weight prefetch in small decode graphs (engine/weight_prefetch.py): the spec, the
wiring (which weight is asked for after which GEMM), and on the GPU that it changes no
token and really launches inside the captured graphs."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine import weight_prefetch
from flashpage.engine.weight_prefetch import WeightPrefetcher, parse_spec
from flashpage.kernels.l2_prefetch import can_prefetch, prefetch_l2
from flashpage.models.loader import load_model, resolve_model
from tests.conftest import random_prompts


def test_parse_spec():
    assert parse_spec("0") == {} and parse_spec("") == {}
    assert parse_spec("1") == {"o_proj": None}
    assert parse_spec("o_proj, down:8,qkv:0.5") == {"o_proj": None, "down": 8 << 20, "qkv": 1 << 19}
    with pytest.raises(ValueError, match="unknown target 'wo'"):
        parse_spec("wo")
    with pytest.raises(ValueError, match="number of MB"):
        parse_spec("down:lots")


def test_nothing_to_prefetch_on_cpu(tiny_checkpoint):
    model = load_model(resolve_model(str(tiny_checkpoint("head64_gqa")), None), torch.float32,
                       torch.device("cpu"))
    t = torch.zeros(1024)
    assert not can_prefetch(t.device) and prefetch_l2(t) == 0
    assert weight_prefetch.attach(model, "o_proj", 8, torch.device("cpu")) is None


def test_pairs_follow_the_layer_order(tiny_checkpoint):
    """Each target's weight is asked for right after the GEMM that precedes it: o_proj
    after qkv, gate_up after o_proj, down after gate_up, the next layer's qkv after down."""
    model = load_model(resolve_model(str(tiny_checkpoint("head64_gqa")), None), torch.float32,
                       torch.device("cpu"))
    layers = model.model.layers
    pairs = weight_prefetch._pairs(model, parse_spec("o_proj,gate_up:1,down,qkv"))
    got = {(id(before), id(w)): cap for before, w, cap in pairs}
    want = {}
    for i, lay in enumerate(layers):
        a, m = lay.self_attn, lay.mlp
        want[(id(a.qkv_proj), id(a.o_proj.weight))] = None
        want[(id(a.o_proj), id(m.gate_up_proj.weight))] = 1 << 20
        want[(id(m.gate_up_proj), id(m.down_proj.weight))] = None
        if i + 1 < len(layers):
            want[(id(m.down_proj), id(layers[i + 1].self_attn.qkv_proj.weight))] = None
    assert got == want


def test_after_gemm_runs_once_per_forward_and_only_while_active(tiny_checkpoint, monkeypatch):
    """The hook fires after each wired GEMM, inside ``step`` only, for small batches only."""
    model = load_model(resolve_model(str(tiny_checkpoint("head64_gqa")), None), torch.float32,
                       torch.device("cpu"))
    asked: list[int] = []
    monkeypatch.setattr(weight_prefetch, "prefetch_l2",
                        lambda w, cap: asked.append(w.data_ptr()) or 1)
    pf = WeightPrefetcher(torch.device("cpu"), max_batch=4)
    pf.stream = _FakeStream()  # type: ignore[assignment]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Null())
    for before, w, cap in weight_prefetch._pairs(model, {"o_proj": None}):
        before.after_gemm = lambda w=w, cap=cap: pf.prefetch(w, cap)
    x = torch.randn(3, model.config.hidden_size)
    for lay in model.model.layers:
        lay.self_attn.qkv_proj(x)
    assert asked == []  # not inside a step
    with pf.step(batch=4):
        for lay in model.model.layers:
            lay.self_attn.qkv_proj(x)
            lay.self_attn.o_proj(torch.randn(3, lay.self_attn.o_proj.weight.shape[1]))
    assert asked == [lay.self_attn.o_proj.weight.data_ptr() for lay in model.model.layers]
    assert pf.issued == len(model.model.layers) and not pf.active
    with pf.step(batch=5):  # above max_batch
        model.model.layers[0].self_attn.qkv_proj(x)
    assert len(asked) == len(model.model.layers)
    weight_prefetch.detach(model)
    assert all(getattr(m, "after_gemm", None) is None for m in model.modules())


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_changes_no_token_gpu(tiny_checkpoint, monkeypatch):
    """fp32 on the GPU: the same tokens with every target prefetched as without, and the
    small graphs really launch the prefetch (Hopper and newer)."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(6, 1, 80, seed=5)

    def run(spec: str) -> tuple[list[list[int]], int]:
        monkeypatch.setenv("FLASHPAGE_L2_PREFETCH", spec)
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="triton",
                  block_size=16, max_num_seqs=8)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        graphs = llm.engine.runner.graphs
        issued = graphs.prefetcher.issued if graphs and graphs.prefetcher else 0
        return [o.outputs[0].token_ids for o in outs], issued

    base, none = run("0")
    got, issued = run("o_proj,gate_up:1,down:1,qkv:1")
    assert got == base and none == 0
    if can_prefetch(torch.device("cuda")):
        assert issued > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_kernel_in_a_graph_gpu():
    dev = torch.device("cuda")
    if not can_prefetch(dev):
        pytest.skip("bulk L2 prefetch needs compute capability 9.0")
    w = torch.randn(4096, 4097, device=dev, dtype=torch.bfloat16)  # odd size: a partial chunk
    assert prefetch_l2(w) == w.numel() * 2 - (w.numel() * 2) % 16
    assert prefetch_l2(w, max_bytes=1000) == 992
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        prefetch_l2(w)
    g.replay()
    torch.cuda.synchronize()
