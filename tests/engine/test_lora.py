"""LoRA adapters (flashpage/lora/): a request with a PEFT adapter gives the greedy tokens of
the checkpoint with that adapter merged into its weights (W + scaling * B @ A, written by
tests/peft_adapter.py from the files alone), a request without one the base model's, in
any mix within one batch, with more adapters than slots, over the prefix cache, with
drafts; a bad adapter fails its own request only, with a message naming the problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flashpage import LLM, LoRARequest, SamplingParams
from flashpage.engine.cuda_graph import PiecewiseGraphs, PrefillGraphs
from flashpage.lora.layers import LoRALinear, LoRAState, lora_delta_ref
from tests.conftest import build_tiny_mla_checkpoint, random_prompts
from tests.peft_adapter import merge_adapter, write_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8)


class Setup:
    """A base checkpoint, three adapters and their merged checkpoints:
    a: every target, r 8; b: q/v/down only, r 4, rsLoRA; c: gate/up/o, r 16."""

    def __init__(self, root: Path, base: Path) -> None:
        self.base = base
        self.adapters = {
            "a": write_adapter(root / "a", base, r=8, alpha=16, seed=1),
            "b": write_adapter(root / "b", base, r=4, alpha=8, seed=2, use_rslora=True,
                               targets=("q_proj", "v_proj", "down_proj")),
            "c": write_adapter(root / "c", base, r=16, alpha=8, seed=3,
                               targets=("gate_proj", "up_proj", "o_proj")),
        }
        self.requests = {n: LoRARequest(n, i + 1, str(p))
                         for i, (n, p) in enumerate(self.adapters.items())}
        self.merged = {n: merge_adapter(base, p, root / f"merged_{n}") for n, p in self.adapters.items()}
        self._solo: dict[tuple[str | None, int], list[list[int]]] = {}

    def solo(self, name: str | None, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Greedy tokens of each prompt alone on the merged checkpoint (None: the base)."""
        key = (name, seed)
        if key not in self._solo:
            llm = LLM(str(self.base if name is None else self.merged[name]), **KW)
            self._solo[key] = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                               for p in prompts]
        return self._solo[key]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("lora"), tiny_checkpoint("llama31_gqa"))


def _tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0].token_ids for o in outs]


def _idle(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished_requests()
    assert e.kv_manager.num_free_blocks == e.num_blocks  # no block leaked


@pytest.mark.parametrize("model", ["llama31_gqa", "qwen2_bias", "qwen3_qknorm"])
def test_adapter_tokens_equal_the_merged_checkpoint(tiny_checkpoint, tmp_path, model):
    base = tiny_checkpoint(model)
    adapter = write_adapter(tmp_path / "a", base, r=8, alpha=16, seed=5)
    merged = merge_adapter(base, adapter, tmp_path / "merged")
    prompts = random_prompts(4, 4, 40, seed=11)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    got = _tokens(llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 7, str(adapter)),
                               use_tqdm=False))
    want = _tokens(LLM(str(merged), **KW).generate(prompts, GREEDY, use_tqdm=False))
    base_want = _tokens(LLM(str(base), **KW).generate(prompts, GREEDY, use_tqdm=False))
    assert got == want
    assert all(g != b for g, b in zip(got, base_want, strict=True))  # the adapter does something
    # the same engine without an adapter: the base model's tokens (slot rows of -1)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == base_want
    _idle(llm)


@pytest.mark.parametrize("async_scheduling,kernels", [(False, False), (True, False), (False, True)],
                         ids=["sync", "async", "kernels"])
def test_mixed_batch_gives_each_prompt_its_solo_tokens(setup, async_scheduling, kernels,
                                                       monkeypatch):
    """kernels: the delta through kernels/lora.py (under the interpreter on the CPU)."""
    if kernels and not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (tests/conftest.py)")
        monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "1")
    prompts = random_prompts(8, 4, 40, seed=3)
    names = ["a", "b", None, "b", "a", None, "c", "a"]
    llm = LLM(str(setup.base), enable_lora=True, max_loras=3, max_lora_rank=16,
              async_scheduling=async_scheduling, **KW)
    seen: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.append(len({r.lora_int_id for r, _ in out.scheduled}))
        return out

    llm.engine.scheduler.schedule = spy
    loras = [setup.requests[n] if n else None for n in names]
    outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    got = _tokens(outs)
    want = [setup.solo(n, prompts, 3)[i] for i, n in enumerate(names)]
    assert got == want
    assert [o.lora_request for o in outs] == loras  # as vLLM's RequestOutput.lora_request
    assert max(seen) == 4  # one step held a, b, c and no adapter together
    assert llm.engine.lora is not None and llm.engine.lora.num_loads == 3
    _idle(llm)


def test_more_adapters_than_slots_wait_and_complete(setup):
    """max_loras=1 and three adapters: requests whose adapter has no slot wait (others
    behind them go), every one completes with its own tokens, and no step ever runs two."""
    prompts = random_prompts(7, 4, 30, seed=4)
    names = ["a", "b", "a", None, "c", "b", "a"]
    llm = LLM(str(setup.base), enable_lora=True, max_loras=1, max_lora_rank=16, **KW)
    per_step: list[set[int]] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        running = {r.lora_int_id for r in llm.engine.scheduler.running if r.lora_int_id}
        assert len(running) <= 1, running
        per_step.append({r.lora_int_id for r, _ in out.scheduled if r.lora_int_id})
        return out

    llm.engine.scheduler.schedule = spy
    loras = [setup.requests[n] if n else None for n in names]
    got = _tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [setup.solo(n, prompts, 4)[i] for i, n in enumerate(names)]
    assert {frozenset(s) for s in per_step} >= {frozenset({1}), frozenset({2}), frozenset({3})}
    # the base request ran beside an adapter's, in the first step (not behind the waiting ones)
    assert llm.engine.lora is not None and llm.engine.lora.num_loads >= 3
    _idle(llm)


def test_preemption_under_adapters(setup):
    """A KV cache too small for the batch: preempted requests come back (their adapter in a
    slot again, maybe another one) and still give their own tokens."""
    prompts = random_prompts(6, 20, 30, seed=9)
    names = ["a", "b", "c", None, "a", "c"]
    llm = LLM(str(setup.base), enable_lora=True, max_loras=2, max_lora_rank=16,
              num_gpu_blocks=14, **KW)
    loras = [setup.requests[n] if n else None for n in names]
    got = _tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [setup.solo(n, prompts, 9)[i] for i, n in enumerate(names)]
    assert llm.engine.scheduler.num_preemptions > 0
    _idle(llm)


def test_prefix_cache_is_not_shared_across_adapters(setup):
    prompt = random_prompts(1, 41, 41, seed=8)[0]  # 5 full blocks of 8, then 1 token
    llm = LLM(str(setup.base), enable_lora=True, max_loras=2, max_lora_rank=16, **KW)
    order = ["a", "b", None, "a", None, "b"]
    cached, got = [], []
    for n in order:
        out = llm.generate([prompt], GREEDY, lora_request=setup.requests[n] if n else None,
                           use_tqdm=False)[0]
        got.append(_tokens([out])[0])
        assert out.metrics is not None
        cached.append(out.metrics.num_cached_tokens)
    # a hit only for the second request of each (adapter or none), never across them
    assert cached == [0, 0, 0, 40, 40, 40]
    assert got == [setup.solo(n, [prompt], 8)[0] for n in order]
    _idle(llm)


def _bad(root: Path, base: Path, case: str) -> tuple[str, str]:
    """A broken adapter folder and a piece of the error it must give."""
    p = root / case
    if case == "missing_path":
        return str(root / "nowhere"), "does not exist"
    if case == "rank_too_large":
        write_adapter(p, base, r=32)
        return str(p), "max_lora_rank=16"
    if case == "no_weights":
        write_adapter(p, base)
        os.remove(p / "adapter_model.safetensors")
        return str(p), "no adapter_model.safetensors"
    if case == "no_config":
        write_adapter(p, base)
        os.remove(p / "adapter_config.json")
        return str(p), "no adapter_config.json"
    if case == "bias":
        write_adapter(p, base, config_extra={"bias": "all"})
        return str(p), "bias='all'"
    if case == "modules_to_save":
        write_adapter(p, base, config_extra={"modules_to_save": ["lm_head"]})
        return str(p), "modules_to_save"
    if case == "embedding_target":
        write_adapter(p, base, config_extra={"target_modules": ["q_proj", "embed_tokens"]})
        return str(p), "embedding"
    if case == "unknown_target":
        write_adapter(p, base, config_extra={"target_modules": ["q_proj", "c_attn"]})
        return str(p), "unknown target module 'c_attn'"
    if case == "unknown_module_tensor":
        from safetensors.torch import load_file, save_file

        write_adapter(p, base)
        w = load_file(str(p / "adapter_model.safetensors"))
        w["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = torch.zeros(8, 64)
        save_file(w, str(p / "adapter_model.safetensors"))
        return str(p), "'model.layers.0.self_attn.rotary' is not one this model can adapt"
    if case == "shape":
        other = json.loads((base / "config.json").read_text())
        other["hidden_size"] = 96
        (root / "other").mkdir(exist_ok=True)
        (root / "other" / "config.json").write_text(json.dumps(other))
        write_adapter(p, root / "other")
        return str(p), "do not fit the base model"
    if case == "dora":
        write_adapter(p, base, config_extra={"use_dora": True})
        return str(p), "DoRA"
    raise AssertionError(case)


BAD_CASES = ["missing_path", "rank_too_large", "no_weights", "no_config", "bias",
             "modules_to_save", "embedding_target", "unknown_target", "unknown_module_tensor",
             "shape", "dora"]


@pytest.fixture(scope="module")
def lora_llm(setup) -> LLM:
    return LLM(str(setup.base), enable_lora=True, max_loras=2, max_lora_rank=16, **KW)


@pytest.mark.parametrize("case", BAD_CASES)
def test_a_bad_adapter_fails_its_request_alone(setup, lora_llm, tmp_path, case):
    path, message = _bad(tmp_path, setup.base, case)
    prompts = random_prompts(3, 4, 20, seed=5)
    loras = [setup.requests["a"], LoRARequest("bad", 99, path), None]
    outs = lora_llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert outs[1].error is not None and message in outs[1].error, outs[1].error
    assert "'bad'" in outs[1].error and not outs[1].outputs
    assert _tokens([outs[0], outs[2]]) == [setup.solo("a", prompts, 5)[0],
                                          setup.solo(None, prompts, 5)[2]]
    _idle(lora_llm)
    assert 99 not in lora_llm.engine.lora.adapters  # type: ignore[union-attr]


def test_one_id_for_two_folders_is_refused(setup, lora_llm):
    a = setup.requests["a"]
    lora_llm.generate([[5, 6, 7]], GREEDY, lora_request=a, use_tqdm=False)
    clash = LoRARequest("other", a.lora_int_id, str(setup.adapters["b"]))
    out = lora_llm.generate([[5, 6, 7]], GREEDY, lora_request=clash, use_tqdm=False)[0]
    assert out.error is not None and "already names adapter 'a'" in out.error
    _idle(lora_llm)


def test_adapter_without_enable_lora_is_refused(setup):
    llm = LLM(str(setup.base), **KW)
    prompts = random_prompts(2, 4, 20, seed=6)
    outs = llm.generate(prompts, GREEDY, lora_request=[setup.requests["a"], None], use_tqdm=False)
    assert outs[0].error is not None and "enable_lora" in outs[0].error
    assert _tokens([outs[1]]) == [setup.solo(None, prompts, 6)[1]]
    _idle(llm)
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompts[:1], GREEDY, lora_request=[None, None], use_tqdm=False)


@pytest.mark.parametrize("args, message", [
    (("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"), (("a", True, "/x"), "lora_int_id"),
    (("a", 1, ""), "lora_path")])
def test_lora_request_fields_are_checked(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_engine_options_are_checked(tiny_checkpoint, tmp_path_factory):
    with pytest.raises(ValueError, match="max_loras"):
        LLM(str(tiny_checkpoint("llama2_mha")), enable_lora=True, max_loras=0, **KW)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(str(tiny_checkpoint("llama2_mha")), enable_lora=True, max_lora_rank=0, **KW)
    mla = build_tiny_mla_checkpoint(tmp_path_factory.mktemp("v2"), "deepseek_v2")
    with pytest.raises(ValueError, match="not supported for DeepseekForCausalLM"):
        LLM(str(mla), enable_lora=True, **KW)


def test_drafts_with_adapters(setup):
    """n-gram drafts (speculative decoding) run and are checked under the request's adapter:
    greedy tokens are the merged checkpoints' plain ones."""
    base = random_prompts(4, 6, 10, seed=12)
    prompts = [p * 3 for p in base]  # repeats: the n-gram lookup finds drafts
    names = ["a", None, "b", "a"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(str(setup.base), enable_lora=True, max_loras=2, max_lora_rank=16,
              speculative_config=spec, **KW)
    loras = [setup.requests[n] if n else None for n in names]
    got = _tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [setup.solo(n, prompts, 12)[i] for i, n in enumerate(names)]
    assert llm.engine.proposer is not None and llm.engine.proposer.stats.num_draft_tokens > 0
    _idle(llm)


@pytest.mark.parametrize("kernels", [False, True], ids=["dense", "kernels"])
def test_lora_linear_matches_the_per_token_reference(kernels, monkeypatch):
    """Fused slices of different widths, ranks under the maximum, tokens of every slot and
    none: the batched delta (dense, or kernels/lora.py's under the interpreter) equals one
    token at a time."""
    if kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (tests/conftest.py)")
    monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "1" if kernels else "0")
    g = torch.Generator().manual_seed(0)
    slices = [(0, 16), (16, 8), (24, 8)]  # q, k, v of a qkv_proj
    state = LoRAState(32, torch.device("cpu"))
    lin = LoRALinear(state, 12, 32, slices, num_slots=3, max_rank=6, device=torch.device("cpu"),
                     dtype=torch.float32)
    pieces = {
        0: {0: (torch.randn(6, 12, generator=g), torch.randn(16, 6, generator=g)),
            2: (torch.randn(6, 12, generator=g), torch.randn(8, 6, generator=g))},
        2: {1: (torch.randn(3, 12, generator=g), torch.randn(8, 3, generator=g))},
    }
    lin.set_slot(1, {0: (torch.ones(2, 12), torch.ones(16, 2))})  # overwritten below: stale
    for s, p in pieces.items():
        lin.set_slot(s, p)
    lin.set_slot(1, {})
    slots = [0, -1, 2, 2, 1, 0, -1, 0, 2]
    state.token_slots[: len(slots)] = torch.tensor(slots)
    x = torch.randn(len(slots), 12, generator=g)
    y0 = torch.randn(len(slots), 32, generator=g)
    assert lin.uses_kernels(x, y0) == kernels
    got = lin.apply(x, y0.clone())
    want = y0 + lora_delta_ref(x, slots, pieces, slices, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], y0[1]) and torch.equal(got[4], y0[4])  # none / an empty slot


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_padded_graph_steps_read_the_slot_map(tiny_checkpoint, tmp_path, monkeypatch):
    """The graphs' padded static-buffer steps (run eagerly on the CPU: capture=False), prompt
    graphs and pieces, read each token's adapter from the slot map: a mixed batch gives
    the eager engine's tokens (its delta dense, theirs through kernels/lora.py: slot -1 on
    the padding)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "0")
    base = tiny_checkpoint("head64_gqa")
    ad = {n: write_adapter(tmp_path / n, base, r=4, alpha=8, seed=i) for i, n in enumerate("ab")}
    reqs = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(ad.items())}
    kw = dict(KW, attention_backend="triton", block_size=16, max_num_batched_tokens=32)
    prompts = random_prompts(5, 3, 20, seed=2)
    loras = [reqs["a"], None, reqs["b"], reqs["a"], None]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eager = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    want = _tokens(eager.generate(prompts, params, lora_request=loras, use_tqdm=False))
    monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "1")
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    assert llm.engine.lora is not None and llm.engine.lora.layers[0].kernel_max_tokens > 0
    runner = llm.engine.runner
    runner.capture_prefill_graphs(32, llm.engine.max_model_len, capture=False)
    runner.capture_piecewise_graphs(32, capture=False)
    ran = {"prompt": 0, "pieces": 0}
    for cls, key in ((PrefillGraphs, "prompt"), (PiecewiseGraphs, "pieces")):
        def spy(self, *a, _real=cls.run, _key=key):
            ran[_key] += 1
            return _real(self, *a)

        monkeypatch.setattr(cls, "run", spy)
    assert _tokens(llm.generate(prompts, params, lora_request=loras, use_tqdm=False)) == want
    # one at a time (whole prompt-step graphs), then all at once (pieces: more than 4 prompts)
    solo = [_tokens(llm.generate([p], params, lora_request=lr, use_tqdm=False))[0]
            for p, lr in zip(prompts, loras, strict=True)]
    assert solo == want
    assert ran["prompt"] >= 5 and ran["pieces"] > 0, ran
    _idle(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_adapters_on_the_gpu_with_graphs(tiny_checkpoint, tmp_path):
    """fp32 on the GPU over our kernels, every graph kind captured: decode graphs, prompt
    graphs and pieces read the slot map in place; a batch mixing two adapters and none gives
    each prompt the merged checkpoint's tokens (and the base model's without an adapter)."""
    base = tiny_checkpoint("head64_gqa")
    ad = {n: write_adapter(tmp_path / n, base, r=8, alpha=16, seed=i) for i, n in enumerate("ab")}
    merged = {n: merge_adapter(base, p, tmp_path / f"merged_{n}") for n, p in ad.items()}
    reqs = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(ad.items())}
    kw = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
              max_num_batched_tokens=128, max_model_len=256, max_num_seqs=16)
    prompts = random_prompts(9, 3, 60, seed=21)
    names = ["a", None, "b", "a", None, "b", "b", "a", None]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want: list[list[int]] = [[] for _ in prompts]
    for name in ("a", "b", None):  # each prompt alone on its merged checkpoint (or the base)
        ref = LLM(str(base if name is None else merged[name]), **kw)
        for i, n in enumerate(names):
            if n == name:
                want[i] = _tokens(ref.generate([prompts[i]], params, use_tqdm=False))[0]
        del ref
        torch.cuda.empty_cache()
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.piecewise is not None
    replays = {"decode": 0, "pieces": 0}
    for key, graphs in (("decode", runner.graphs), ("pieces", runner.piecewise)):
        def spy(*a, _real=graphs.run, _key=key, **k):
            replays[_key] += 1
            return _real(*a, **k)

        graphs.run = spy  # type: ignore[method-assign]
    got = _tokens(llm.generate(prompts, params, lora_request=[reqs[n] if n else None for n in names],
                               use_tqdm=False))
    assert got == want
    assert replays["decode"] > 0 and replays["pieces"] > 0, replays
    _idle(llm)


def test_remove_lora_spares_running_requests(setup):
    """remove_lora (vLLM's) while a request runs with the adapter: it finishes with it (the
    merged checkpoint's tokens); once nothing holds it, the adapter and its slot are gone,
    and the same id read again from its folder answers the same."""
    llm = LLM(str(setup.base), enable_lora=True, max_loras=1, max_lora_rank=16, **KW)
    e = llm.engine
    prompt = random_prompts(1, 6, 6, seed=905)[0]
    want = setup.solo("a", [prompt], seed=905)[0]  # (solo's cache is keyed by seed: one of its own)
    a = setup.requests["a"]
    e.add_request("r", prompt, GREEDY, lora_request=a)
    outs = e.step()
    assert e.remove_lora(a.lora_int_id)  # held by "r": kept for it
    assert a.lora_int_id in e.lora.adapters
    while e.has_unfinished_requests():
        outs += e.step()
    assert [o for o in outs if o.finished][0].outputs[0].token_ids == want
    assert e.remove_lora(a.lora_int_id)
    assert a.lora_int_id not in e.lora.adapters and e.lora.slots == [None]
    assert not e.remove_lora(a.lora_int_id)  # no longer loaded
    assert _tokens(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)) == [want]
    _idle(llm)
