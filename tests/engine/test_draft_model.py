"""Speculative decoding with a draft model (engine/draft_model.py): greedy requests get plain
decoding's tokens whatever the draft proposes, and a draft that is the target itself has
every draft accepted (its K/V pool, indexed by the target's block ids, stays in step)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.config import EngineConfig
from flashpage.engine.spec_decode import SpeculativeConfig
from tests.conftest import build_tiny_checkpoint, random_prompts

K = 3


def _llm(path, draft=None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8, **kw}
    spec = None if draft is None else {"model": str(draft), "num_speculative_tokens": K,
                                       **kw.pop("spec", {})}
    return LLM(str(path), speculative_config=spec, **kw)


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_checkpoint):
    """name -> a draft checkpoint for llama31_gqa: "other" a different random model (one
    layer, 1 KV head, seed 1); "noisy" the target's weights with noise (drafts that are
    mostly right: acceptance and rejection both)."""
    target = tiny_checkpoint("llama31_gqa")
    other = build_tiny_checkpoint(tmp_path_factory.mktemp("draft_other"), "mqa", seed=1,
                                  num_hidden_layers=1)
    noisy = noisy_copy(target, tmp_path_factory.mktemp("draft_noisy"))
    return {"self": target, "other": other, "noisy": noisy}


def noisy_copy(target, dest):
    """``target``'s checkpoint with noise on its weights (norms kept) into ``dest``."""
    from safetensors.torch import load_file, save_file

    shutil.copy(target / "config.json", dest / "config.json")
    g = torch.Generator().manual_seed(3)
    weights = {k: v + 0.005 * torch.randn(v.shape, generator=g) if "norm" not in k else v
               for k, v in load_file(target / "model.safetensors").items()}
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _prompts() -> list[list[int]]:
    """5 prompts, two sharing a 20-token prefix (a prefix-cache hit in both pools)."""
    shared = random_prompts(1, 20, 20, seed=9)[0]
    return random_prompts(3, 5, 40, seed=2) + [shared + p for p in random_prompts(2, 3, 9, seed=4)]


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_checkpoint, drafts):
    """Chunked prefill (16-token budget), a prefix hit, batch 5: the draft's pool holds
    the target's tokens at the target's slots, so its argmax is the target's every time."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = _ids(_llm(path), prompts, params)
    llm = _llm(path, drafts["self"], max_num_batched_tokens=16)
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    assert st["mean_accepted_length"] > K  # 1 + accepted drafts per checking step
    assert llm.engine.kv_manager.prefix_hits > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("which", ["other", "noisy"])
def test_a_different_draft_gives_plain_decodings_tokens(tiny_checkpoint, drafts, which):
    """A draft that is mostly wrong (another random model) or mostly right (noisy weights):
    batch, chunked prefill, a prefix hit; the tokens are plain decoding's."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = _ids(_llm(path), prompts, params)
    llm = _llm(path, drafts[which], max_num_batched_tokens=24, spec={"backoff": False})
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] >= len(prompts) * (20 // (K + 1))
    if which == "noisy":
        assert 0.3 < st["acceptance_rate"] < 1.0, st
    else:
        assert st["acceptance_rate"] < 0.3, st
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_preemption_and_async_backoff_keep_the_tokens(tiny_checkpoint, drafts, monkeypatch):
    """A cache too small for every request (preemptions: both pools' blocks freed and
    recomputed), then async scheduling with the back-off on (a wrong draft backs off; the
    draft catches up on tokens sampled while it was not looking)."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(path), prompts, params)
    llm = _llm(path, drafts["noisy"], block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.kv_manager.stats().blocks_used == 0
    from flashpage.engine.scheduler import Scheduler

    real, unresolved = Scheduler.schedule, []

    def spy(self):
        unresolved.append(any(r.num_unresolved for r in self.running))
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", spy)
    llm = _llm(path, drafts["other"], async_scheduling=True)
    assert _ids(llm, prompts, params) == want
    assert any(unresolved), "backed-off requests were meant to schedule asynchronously"
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_sampled_requests_with_a_draft_are_seeded_and_counted(tiny_checkpoint, drafts):
    """Seeded sampling with the target as draft: the same tokens alone or in a batch; the
    drafts, drawn from the draft's q and checked against it, are all accepted."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(3, 5, 20, seed=6)
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=5)
    llm = _llm(path, drafts["self"])
    alone = _ids(llm, prompts[:1], seeded)[0]
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert _ids(llm, prompts, [seeded, other, other])[0] == alone
    st = llm.engine.stats()["spec_decode"]
    # q = p (the same model, processed alike): min(1, p/q) accepts every draft, where checking
    # them as certain drafts accepted sum(p^2) of them (2% here: flat distributions)
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] > 0.95, st
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_unspeculable_requests_decode_beside_drafted_ones(tiny_checkpoint, drafts):
    """A request with a repetition penalty is not drafted (its sampling reads its tokens one
    at a time) but its tokens still fill the draft's pool; both get plain decoding's tokens."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(2, 8, 16, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)]
    want = _ids(_llm(path), prompts, params)
    llm = _llm(path, drafts["self"])
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    # the first request alone drafts: 3 + 3 + 2 drafts (room: max_tokens) after its prompt step
    assert (st["num_drafts"], st["num_draft_tokens"], st["acceptance_rate"]) == (3, 8, 1.0), st


def test_the_kv_budget_holds_both_pools(tiny_checkpoint, drafts):
    """A block costs the target's and the draft's bytes: the same memory gives fewer
    blocks, and the draft's pool has one for each of the target's."""
    path, mem = tiny_checkpoint("llama31_gqa"), 1 << 20
    plain = _llm(path, kv_cache_memory=mem).engine
    eng = _llm(path, drafts["other"], kv_cache_memory=mem).engine
    draft_cfg = eng.proposer.runner.config
    per_token = plain.model_config.kv_bytes_per_token("float32")
    assert plain.num_blocks == mem // (8 * per_token)
    assert eng.num_blocks == mem // (8 * (per_token + draft_cfg.kv_bytes_per_token("float32")))
    assert eng.num_blocks < plain.num_blocks
    layers = eng.proposer.runner.model.attention_layers()
    assert len(layers) == 1 and all(c.shape[0] == eng.num_blocks for c in layers[0].kv_cache)


def test_draft_model_config_from_vllm_words(drafts):
    """A model with no method means draft_model (as vLLM infers it); JSON text too."""
    c = SpeculativeConfig.parse({"model": str(drafts["other"]), "num_speculative_tokens": 2})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", str(drafts["other"]), 2)
    c = SpeculativeConfig.parse(json.dumps({"method": "draft_model", "model": str(drafts["self"])}))
    assert c is not None and c.method == "draft_model"


def test_bad_draft_models_are_named(tmp_path, drafts, tiny_checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(speculative_config={"model": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="needs a model"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="is for method 'draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": str(drafts["other"])})
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.loads((drafts["other"] / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        EngineConfig(speculative_config={"model": str(odd)})
    import transformers

    from tests.conftest import TINY_MLA_MODELS

    cls_name, extra = TINY_MLA_MODELS["deepseek_v3"]  # MLA and MoE: its config.json alone
    mla = tmp_path / "mla"
    getattr(transformers, cls_name)(vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, **extra).save_pretrained(mla)
    with pytest.raises(ValueError, match="draft models must be dense with MHA/GQA"):
        EngineConfig(speculative_config={"model": str(mla)})
    wide = build_tiny_checkpoint(tmp_path / "wide", "llama2_mha", vocab_size=300, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocab_size 300, the target 256"):
        _llm(tiny_checkpoint("llama31_gqa"), wide)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_the_draft_on_the_triton_backend(tiny_checkpoint):
    """The triton backend's kernels (interpreted) for both pools: the target as its own
    draft, every draft accepted, plain decoding's tokens (torch_native's, which the backend
    tests hold equal to triton's)."""
    path = tiny_checkpoint("head64_gqa")
    prompts = [random_prompts(1, 4, 4, seed=8)[0], random_prompts(1, 9, 9, seed=9)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = _ids(_llm(path, block_size=16), prompts, params)  # torch_native: as the tests of
    llm = _llm(path, path, attention_backend="triton", block_size=16,  # both backends say
               spec={"num_speculative_tokens": 2})  # (interpreted: each forward takes seconds)
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("draft", ["self", "other"])
def test_the_draft_on_the_gpu_with_graphs(tiny_checkpoint, tmp_path, draft):
    """fp32 on the GPU, triton backend, the target's graphs captured (the draft runs
    eagerly): plain decoding's tokens; the target as its own draft has (nearly) every draft
    accepted (its drafts come from the decode kernel, the checks from the prefill one)."""
    path = tiny_checkpoint("head64_gqa")
    other = build_tiny_checkpoint(tmp_path / "d", "head64_gqa", seed=1, num_hidden_layers=1)
    prompts = random_prompts(5, 5, 40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=128)
    want = _ids(_llm(path, **kw), prompts, params)
    llm = _llm(path, path if draft == "self" else other, **kw)
    assert llm.engine.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0
    if draft == "self":
        assert st["acceptance_rate"] > 0.95, st
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4)], ids=["plain", "top_k"])
def test_sampled_drafts_from_q_keep_the_model_distribution(params):
    """Drafts drawn from a draft distribution q far from the model's p, checked with q
    (accept with min(1, p/q), else draw from max(p - q, 0)): the first token a step emits is
    distributed as p (processed as the request samples), and drafts are accepted at the
    rate sum(min(p, q)) (checking them as certain drafts keeps p too, but accepts only
    sum(p * q): 0.09 here against 0.40)."""
    from flashpage.engine.sequence import Request
    from flashpage.engine.spec_decode import processed_probs, verify_drafts

    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    want = processed_probs(logits, [params], 8)[0]
    q = torch.softmax(torch.tensor([-1.0, 0.0, 2.0, 0.5, 1.0, 1.5, 0.0, 1.0]), dim=-1)
    n = 40_000
    drafts = torch.multinomial(q, n, replacement=True).tolist()
    reqs = []
    for d in range(8):  # one request per draft token, each with q as its draft's distribution
        reqs.append(Request(str(d), [1, 2], params))
        reqs[-1].spec_probs = q[None]
    got = verify_drafts(logits.expand(n, -1), [(reqs[d], [d]) for d in drafts], 8)
    firsts = torch.tensor([c.accepted[0] if c.accepted else c.drawn for c in got])
    freq = torch.bincount(firsts, minlength=8).float() / n
    assert torch.allclose(freq, want, atol=0.012), (freq, want)
    accepted = sum(bool(c.accepted) for c in got) / n
    assert accepted == pytest.approx(float(torch.minimum(want, q).sum()), abs=0.012)
