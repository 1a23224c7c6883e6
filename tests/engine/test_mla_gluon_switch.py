"""FLASHPAGE_MLA_GLUON: the triton backend's MLA decode through the persistent Gluon kernel
(kernels/mla_decode_gluon.py; "1") or the wgmma one (kernels/mla_decode_wgmma.py; "wgmma";
unset: for 16 heads) where mla_gluon_unsupported allows it.

CPU: the routing of TritonBackend.forward_mla_decode with the kernels' plans stubbed (off, or unset
at 128 heads: the Gluon check is never asked; on, on the CPU: the reasons name the device and the Triton
kernel runs; on, reasons empty: the Gluon entry gets the decodes' q, block tables and
lengths). GPU (sm_90): a tiny DeepSeek-V2 with V2-Lite's attention dims (16 heads, latent
512 + 64) decodes through the Gluon kernel, CUDA graphs included, and its fp16 greedy
tokens follow the fp32 ones as far as the Triton kernel's do.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import build_tiny_mla_checkpoint, random_prompts
from tests.engine.test_triton_backend import _leading_agreement

RANK, ROPE, H = 512, 64, 16


def _decode(monkeypatch, switch: str | None, reasons: list[str] | None, heads: int = H):
    import flashpage.kernels.mla_decode as md_mod
    import flashpage.kernels.mla_decode_gluon as mg
    import flashpage.kernels.mla_decode_wgmma as mw
    from flashpage.attention.triton import TritonBackend

    calls: dict[str, list] = {"triton": [], "gluon": [], "wgmma": [], "asked": []}

    def planner(name, value):  # a kernel's plan: records its call, launches write ``value``
        def plan(q, kv, tables, lens, *, kv_lora_rank, sm_scale, out, **kw):
            calls[name].append((q, tables, lens))
            return lambda q, kc, vc, out: out.fill_(value)
        return plan

    def gluon_stub(q, kv, tables, lens, *, kv_lora_rank, sm_scale, out):
        calls["gluon"].append((q, tables, lens))
        out.fill_(2)

    real_check = mg.mla_gluon_unsupported

    def check(*args, **kwargs):
        calls["asked"].append(1)
        return real_check(*args, **kwargs) if reasons is None else reasons

    monkeypatch.setattr(md_mod, "_plan", planner("triton", 1))
    monkeypatch.setattr(mg, "mla_decode_gluon", gluon_stub)
    monkeypatch.setattr(mw, "plan", planner("wgmma", 3))
    monkeypatch.setattr(mg, "mla_gluon_unsupported", check)
    if switch is None:
        monkeypatch.delenv("FLASHPAGE_MLA_GLUON", raising=False)
    else:
        monkeypatch.setenv("FLASHPAGE_MLA_GLUON", switch)
    backend = TritonBackend(SimpleNamespace(is_mla=True), torch.device("cpu"), torch.bfloat16)
    q = torch.randn(3, heads, RANK + ROPE).transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
    kv = torch.zeros(8, 16, RANK + ROPE, dtype=torch.bfloat16)
    md = SimpleNamespace(block_tables=torch.arange(10, dtype=torch.int32).view(5, 2),
                         seq_lens=torch.tensor([5, 9, 17, 3, 3], dtype=torch.int32), extra={})
    out = backend.forward_mla_decode(q.bfloat16(), kv, md, kv_lora_rank=RANK, scale=0.1)
    # a second layer of the step: the plan launches again, nothing is chosen or planned anew
    asked, planned = len(calls["asked"]), len(calls["triton"]) + len(calls["wgmma"])
    out2 = backend.forward_mla_decode(q.bfloat16(), kv, md, kv_lora_rank=RANK, scale=0.1)
    assert torch.equal(out2, out) and len(calls["asked"]) == asked
    assert len(calls["triton"]) + len(calls["wgmma"]) == planned
    return out, calls


def test_switch_off_never_asks(monkeypatch):
    out, calls = _decode(monkeypatch, "0", None)
    assert not calls["asked"] and not calls["gluon"] and len(calls["triton"]) == 1
    assert (out == 1).all()


@pytest.mark.parametrize("switch", [None, ""])
def test_switch_unset_takes_wgmma_for_16_heads_only(monkeypatch, switch):
    """Unset (or empty): the wgmma kernel where it covers the call and q has one 16-head group;
    128 heads (compute-bound, Triton's kernel faster) never ask."""
    out, calls = _decode(monkeypatch, switch, [])
    assert calls["asked"] and len(calls["wgmma"]) == 1 and not calls["triton"] and (out == 3).all()
    out, calls = _decode(monkeypatch, switch, [], heads=128)
    assert not calls["asked"] and not calls["wgmma"] and len(calls["triton"]) == 1 and (out == 1).all()


def test_switch_unset_on_the_cpu_runs_triton(monkeypatch):
    """Unset, 16 heads, on the CPU: the kernel's reasons (no CUDA) send the decodes to Triton's."""
    out, calls = _decode(monkeypatch, None, None)
    assert calls["asked"] and not calls["wgmma"] and len(calls["triton"]) == 1 and (out == 1).all()


def test_switch_on_without_hopper_runs_triton(monkeypatch):
    import flashpage.kernels.mla_decode_gluon as mg

    out, calls = _decode(monkeypatch, "1", None)
    assert calls["asked"] and not calls["gluon"] and (out == 1).all()
    q = torch.zeros(1, H, RANK + ROPE, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, RANK + ROPE, dtype=torch.bfloat16)
    why = mg.mla_gluon_unsupported(q, kv, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), kv_lora_rank=RANK)
    assert any("CUDA" in w for w in why)


@pytest.mark.parametrize("switch,kernel,value", [("1", "gluon", 2), ("gluon", "gluon", 2), ("wgmma", "wgmma", 3)])
def test_switch_on_hands_the_decodes_to_gluon(monkeypatch, switch, kernel, value):
    out, calls = _decode(monkeypatch, switch, [])
    other = {"gluon": "wgmma", "wgmma": "gluon"}[kernel]
    # the wgmma kernel is planned once for both layers, the mma.sync one called by each
    launches = {"gluon": 2, "wgmma": 1}[kernel]
    assert not calls["triton"] and not calls[other] and len(calls[kernel]) == launches and (out == value).all()
    q, tables, lens = calls[kernel][0]
    assert q.is_contiguous() and q.shape == (3, H, RANK + ROPE)
    assert tables.shape == (3, 2) and lens.tolist() == [5, 9, 17]


def test_switch_wgmma_without_hopper_runs_triton_and_bad_values_fail(monkeypatch):
    out, calls = _decode(monkeypatch, "wgmma", None)
    assert calls["asked"] and not calls["wgmma"] and (out == 1).all()
    with pytest.raises(ValueError, match="FLASHPAGE_MLA_GLUON must be unset, 0, 1 .gluon. or wgmma, got 'yes'"):
        _decode(monkeypatch, "yes", [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("switch", ["1", "wgmma"])
def test_gluon_mla_decode_in_the_engine_gpu(tmp_path, monkeypatch, switch):
    import importlib

    from flashpage import LLM, SamplingParams

    # the engine plans the wgmma kernel once a step (mla_decode_wgmma.plan); the mma.sync one is
    # called by every layer
    module, entry = {"1": ("mla_decode_gluon", "mla_decode_gluon"), "wgmma": ("mla_decode_wgmma", "plan")}[switch]
    mg = importlib.import_module(f"flashpage.kernels.{module}")

    # fp16 and fan-in scaled weights: in bf16 (or at std 0.2 throughout) this model's greedy
    # tokens leave the fp32 ones within a few steps whatever the kernel (H200 run 84: Triton and
    # Gluon alike ~90 of 495; torch_native on the CPU 81); fp16 + fan_in_init: 403 on the CPU.
    path = build_tiny_mla_checkpoint(tmp_path / "v2lite_dims", "deepseek_v2", fan_in_init=True,
                                     num_attention_heads=H, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                                     qk_nope_head_dim=128, v_head_dim=128)
    prompts = random_prompts(24, 1, 200, seed=13)
    prompts.append(prompts[2] + [4, 5, 6])  # a prefix hit
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 7), ignore_eos=True)
              for i in range(len(prompts))]

    def tokens(backend, dtype, **kw):
        llm = LLM(str(path), dtype=dtype, device="cuda", attention_backend=backend, block_size=16, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    truth = tokens("torch_native", "float32")
    monkeypatch.setenv("FLASHPAGE_MLA_GLUON", "0")
    triton16 = _leading_agreement(tokens("triton", "float16", max_num_seqs=16), truth)
    calls = []
    real = getattr(mg, entry)

    def spy(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(mg, entry, spy)
    monkeypatch.setenv("FLASHPAGE_MLA_GLUON", switch)
    gluon16 = _leading_agreement(tokens("triton", "float16", max_num_seqs=16), truth)
    total = sum(len(t) for t in truth)
    assert calls, f"the Gluon MLA decode ({entry}) was never called"
    assert gluon16 >= triton16 - 0.05 * total, (gluon16, triton16, total)
    assert gluon16 >= 0.5 * total, (gluon16, total)
