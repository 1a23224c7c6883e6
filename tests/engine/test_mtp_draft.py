"""Speculative decoding with GLM-4.5's and DeepSeek-V3's multi-token-prediction layer
(engine/mtp.py, models/mtp.py), on tiny Glm4Moe and DeepseekV3 checkpoints with an MTP layer
added to their safetensors (transformers does not create one: synthesized under the
checkpoint's names). Every test runs on both families (DeepSeek-V3's layer attends with MLA).

CPU, fp32, torch_native (and the triton backend interpreted): greedy tokens with MTP drafts
equal plain decoding's and transformers' (batched, chunked prefill, prefix hits, preemption)
and every draft an independent reference's (transformers' hidden states and decoder layer;
under async scheduling too, the back-off on); an MTP layer built to predict the target
exactly has every draft accepted (the same with eh_proj's embedding / hidden halves swapped does not); random
MTP weights count proposals and acceptances consistently; sampled requests are seeded; a
request missing from the last step drafts nothing that step; bad configs are ConfigErrors;
the CLI takes the method; both pools' blocks all come back. GPU (marked gpu): the target's
CUDA graphs hand the layer their hidden states.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError
from flashpage.engine.mtp import MTPProposer
from tests.conftest import (
    build_tiny_mla_checkpoint,
    edited_copy,
    hf_greedy,
    random_prompts,
    tiny_table_builder,
)

K = 3
H = 64
# GLM-4.5 shaped: a dense first layer, 8 experts in 2 groups, top-2, a shared expert, q/k
# norms, q/k/v biased (test_glm_families' glm4_moe, head_dim 32: the triton backend's)
TINY = {"glm4_moe": ("Glm4MoeConfig", dict(
    num_hidden_layers=2, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True, first_k_dense_replace=1))}
_build = tiny_table_builder(TINY)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _layers(t: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(k.split(".")[2]) for k in t if k.startswith("model.layers."))


def add_mtp(t: dict[str, torch.Tensor], seed: int = 5, copies: bool = False) -> None:
    """An MTP layer at model.layers.N (N = num_hidden_layers): layer N - 1's decoder weights
    (a MoE layer) with noise, random eh_proj, norms near 1; ``copies``: the embedding and
    head copied under it too, as DeepSeek-V3's checkpoints hold them."""
    g = torch.Generator().manual_seed(seed)
    n = _layers(t)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for k in [k for k in t if k.startswith(last)]:
        v = t[k]
        noise = 0.0 if "norm" in k or "bias" in k else 0.02 * torch.randn(v.shape, generator=g)
        t[k.replace(last, mtp)] = (v + noise).contiguous()
    t[mtp + "eh_proj.weight"] = 0.1 * torch.randn(H, 2 * H, generator=g)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        t[f"{mtp}{name}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    if copies:
        t[mtp + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
        t[mtp + "shared_head.head.weight"] = t["lm_head.weight"].clone()


def exact_mtp(t: dict[str, torch.Tensor], swap: bool = False) -> None:
    """A target whose layers add nothing (o_proj, the MLPs' down projections, experts and
    shared experts zero): its next token is f(token) = argmax lm_head(norm(embed(token))).
    Its MTP layer reads the embedding half only (eh_proj = [I | 0]; ``swap``: the hidden
    half, [0 | I]), its block adds nothing and shared_head.norm is the final norm: it
    predicts f(token t + 1) = token t + 2 exactly, so every greedy draft is right."""
    for k in list(t):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = torch.zeros_like(t[k])
    n = _layers(t)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for k in [k for k in t if k.startswith(last)]:
        t[k.replace(last, mtp)] = t[k].clone()
    eye, zero = torch.eye(H), torch.zeros(H, H)
    t[mtp + "eh_proj.weight"] = torch.cat([zero, eye] if swap else [eye, zero], dim=1)
    t[mtp + "enorm.weight"] = torch.ones(H)
    t[mtp + "hnorm.weight"] = torch.ones(H)
    t[mtp + "shared_head.norm.weight"] = t["model.norm.weight"].clone()


def _with_mtp(path: Path, dst: Path, edit) -> Path:
    return edited_copy(path, dst, edit, lambda c: c.update(num_nextn_predict_layers=1))


# family -> (its transformers config class, the MTP layer's index, an attention tensor of it)
FAMILIES = {"glm4_moe": ("Glm4MoeConfig", 2, "self_attn.k_proj.weight"),
            "deepseek_v3": ("DeepseekV3Config", 3, "self_attn.kv_a_proj_with_mqa.weight")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpts(request, tmp_path_factory):
    family = request.param
    cls_name, index, attn = FAMILIES[family]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    path = tmp_path_factory.mktemp(family)
    base = (_build(path, family, 0) if family == "glm4_moe"
            else build_tiny_mla_checkpoint(path, family))
    root = tmp_path_factory.mktemp("mtp")
    return {
        "family": family, "index": index, "attn": attn,
        "base": base,
        "random": _with_mtp(base, root / "random", add_mtp),
        "copies": _with_mtp(base, root / "copies", lambda t: add_mtp(t, copies=True)),
        "exact": _with_mtp(base, root / "exact", exact_mtp),
        "swapped": _with_mtp(base, root / "swapped", lambda t: exact_mtp(t, swap=True)),
    }


def _llm(path: Path, mtp: bool = True, spec: dict | None = None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8,
          "attention_backend": "torch_native", **kw}
    cfg = {"method": "mtp", "num_speculative_tokens": K, **(spec or {})} if mtp else None
    return LLM(str(path), speculative_config=cfg, **kw)


def _ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts() -> list[list[int]]:
    """5 prompts, two sharing a 20-token prefix (a prefix-cache hit in both pools)."""
    shared = random_prompts(1, 20, 20, seed=9)[0]
    return random_prompts(3, 5, 40, seed=2) + [shared + p for p in random_prompts(2, 3, 9, seed=4)]


def spy_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """From now on, each step's drafting requests' tokens and drafts (MTPProposer.fill
    spied), in the order drafted."""
    seen: list[tuple[list[int], list[int]]] = []
    real = MTPProposer.fill

    def spy(self, out):
        real(self, out)
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids)) for r, _ in out.scheduled
                    if r.spec_token_ids)

    monkeypatch.setattr(MTPProposer, "fill", spy)
    return seen


def _no_leak(llm: LLM) -> None:
    """Every block back (the MTP layer's pool has the target's block ids: one count)."""
    assert isinstance(llm.engine.proposer, MTPProposer)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_greedy_tokens_equal_plain_decoding_and_transformers(ckpts):
    """Random MTP weights (drafts mostly wrong): batch 5, chunked prefill (16-token budget),
    a prefix hit; the tokens are plain decoding's and transformers'."""
    prompts = _prompts()
    want = _ids(_llm(ckpts["base"], mtp=False), prompts)
    assert want == hf_greedy(ckpts["base"], prompts, GREEDY.max_tokens)
    llm = _llm(ckpts["random"], max_num_batched_tokens=16, spec={"backoff": False})
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] >= len(prompts) * (GREEDY.max_tokens // (K + 1))
    assert llm.engine.kv_manager.prefix_hits > 0
    _no_leak(llm)


def test_an_exact_mtp_layer_has_every_draft_accepted(ckpts):
    """The MTP layer built to predict the target's token after next exactly: every draft
    accepted, 1 + K tokens a checking step; the same weights with the embedding and hidden
    halves of eh_proj swapped predict the NEXT token instead and are mostly rejected."""
    prompts = _prompts()
    want = _ids(_llm(ckpts["exact"], mtp=False), prompts)
    llm = _llm(ckpts["exact"], max_num_batched_tokens=24)
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    assert st["mean_accepted_length"] > K  # 1 + K but where max_tokens leaves less room
    _no_leak(llm)
    bad = _llm(ckpts["swapped"], spec={"backoff": False})
    assert _ids(bad, prompts) == want
    st = bad.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] < 0.5, st


def test_random_mtp_weights_count_drafts_consistently(ckpts):
    """Counters: each checking step proposes at most K drafts, accepts at most those, and
    the outputs' lengths are the steps' tokens."""
    prompts = random_prompts(4, 6, 20, seed=7)
    llm = _llm(ckpts["random"], spec={"backoff": False})
    outs = _ids(llm, prompts)
    st = llm.engine.stats()["spec_decode"]
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert st["num_drafts"] > 0 and st["num_drafts"] * K >= st["num_draft_tokens"] >= st["num_drafts"]
    assert 0 <= st["num_accepted_tokens"] <= st["num_draft_tokens"]
    assert st["acceptance_rate"] < 1.0
    assert st["mean_accepted_length"] == pytest.approx(1 + st["num_accepted_tokens"] / st["num_drafts"])
    _no_leak(llm)


def test_the_checkpoints_embedding_and_head_copies(ckpts):
    """embed_tokens / shared_head.head under the MTP layer equal to the target's: shared,
    the same tokens and drafts as without them."""
    prompts = random_prompts(3, 5, 20, seed=3)
    a = _llm(ckpts["random"], spec={"backoff": False})
    b = _llm(ckpts["copies"], spec={"backoff": False})
    assert _ids(a, prompts) == _ids(b, prompts)
    assert a.engine.stats()["spec_decode"] == b.engine.stats()["spec_decode"]
    assert b.engine.mtp is not None and b.engine.mtp.embed_tokens is None and b.engine.mtp.head is None


def test_preemption_keeps_the_tokens(ckpts):
    """A cache too small for every request (preemptions: both pools' blocks freed, the
    MTP layer's entries recomputed)."""
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["exact"], mtp=False), prompts, params)
    llm = _llm(ckpts["exact"], block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0
    _no_leak(llm)


def spy_async(monkeypatch) -> tuple[list[bool], list[int]]:
    """From now on, for each step: whether a running request had a token still being
    sampled when it was scheduled (async scheduling), and how many requests' hidden states
    the MTP layer held for a later step after its fill."""
    from flashpage.engine.scheduler import Scheduler

    unresolved: list[bool] = []
    held: list[int] = []
    schedule, fill = Scheduler.schedule, MTPProposer.fill

    def spy_schedule(self):
        unresolved.append(any(r.num_unresolved for r in self.running))
        return schedule(self)

    def spy_fill(self, out):
        fill(self, out)
        held.append(len(self._held))

    monkeypatch.setattr(Scheduler, "schedule", spy_schedule)
    monkeypatch.setattr(MTPProposer, "fill", spy_fill)
    return unresolved, held


@pytest.mark.parametrize("tight", [False, True])
def test_async_scheduling_while_nobody_drafts(ckpts, tmp_path, monkeypatch, tight):
    """Async scheduling with the back-off on (random MTP weights: drafts mostly wrong, the
    requests back off): while nobody drafts (prompts, backed-off requests) a step is
    scheduled before the last is read back, and a position whose next token was still being
    sampled has its hidden state held for a later step. The tokens are the synchronous
    run's and plain decoding's, and every draft still equals the independent reference's
    (the layer's entries all computed, the held ones late); ``tight``: a cache too small
    for every request (preemptions drop what was held) and chunked prefill."""
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32) if tight else {}
    want = _ids(_llm(ckpts["random"], mtp=False), prompts, params)
    sync = _llm(ckpts["random"], async_scheduling=False, enable_prefix_caching=False, **kw)
    assert _ids(sync, prompts, params) == want
    llm = _llm(ckpts["random"], async_scheduling=True, enable_prefix_caching=False, **kw)
    seen = spy_drafts(monkeypatch)
    unresolved, held = spy_async(monkeypatch)
    assert _ids(llm, prompts, params) == want
    assert any(unresolved), "backed-off requests were meant to schedule asynchronously"
    assert any(held), "a position's next token was meant to be in flight at a fill"
    if tight:
        assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0 and len(seen) >= 5
    ref = _Reference(ckpts["random"], tmp_path, ckpts["index"])
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), (len(tokens), drafts)
    _no_leak(llm)


def test_sampled_requests_are_seeded(ckpts):
    """Sampled requests draw drafts from the MTP layer's q: a seed gives the same tokens
    twice; the exact layer's drafts at temperature > 0 are still mostly accepted."""
    prompts = random_prompts(3, 5, 20, seed=11)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = _ids(_llm(ckpts["exact"]), prompts, params)
    llm = _llm(ckpts["exact"])
    assert _ids(llm, prompts, params) == a
    assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    _no_leak(llm)


def test_config_errors(ckpts, tmp_path):
    """No MTP layer, its weights missing, a family without one, a model given: each a
    clear error naming it."""
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        _llm(ckpts["base"])
    mtp, attn = f"model.layers.{ckpts['index']}.", ckpts["attn"]
    gone = edited_copy(ckpts["random"], tmp_path / "gone",
                       lambda t: [t.pop(k) for k in list(t) if k.startswith(mtp)])
    with pytest.raises(ConfigError, match="no tensors of the MTP layer"):
        _llm(gone)
    part = edited_copy(ckpts["random"], tmp_path / "part",
                       lambda t: [t.pop(k) for k in (mtp + "hnorm.weight", mtp + attn)])
    with pytest.raises(ConfigError, match=r"2 weight\(s\) of the MTP layer missing") as e:
        _llm(part)
    assert mtp + "hnorm.weight" in str(e.value) and mtp + attn in str(e.value)
    with pytest.raises(ValueError, match="the MTP layer is the target checkpoint's own"):
        _llm(ckpts["random"], spec={"model": str(ckpts["random"])})


def test_a_family_without_mtp_layers_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers"):
        _llm(tiny_checkpoint("llama31_gqa"))


class _Reference:
    """The MTP layer computed apart from our code: transformers' model (the target's final
    hidden states: ``last_hidden_state``, after the final norm; the layer's decoder block:
    transformers' own decoder layer loaded from the checkpoint's MTP layer through a copy of
    it with one layer more) and the layout of models/mtp.py written out in torch.
    ``drafts(tokens, k)``: the k greedy drafts after ``tokens`` (draft 1 from the entry at
    len - 2, each further one fed the last draft and the block's last output row)."""

    def __init__(self, path: Path, tmp: Path, index: int) -> None:
        from safetensors.torch import load_file

        model_cls = transformers.AutoModelForCausalLM
        self.hf = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        t = load_file(str(path / "model.safetensors"))
        mtp = f"model.layers.{index}."
        self.w = {k.removeprefix(mtp): v for k, v in t.items() if k.startswith(mtp)}
        own = tuple(mtp + o for o in ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens."))
        more = edited_copy(path, tmp / "more", lambda d: [d.pop(k) for k in list(d) if k.startswith(own)],
                           lambda c: c.update(num_hidden_layers=index + 1, num_nextn_predict_layers=0))
        hf_more = model_cls.from_pretrained(more, dtype=torch.float32, attn_implementation="eager")
        self.block, self.rotary = hf_more.model.layers[index], hf_more.model.rotary_emb
        self.eps = self.hf.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor(tokens)
        h = self.hf.model(ids[None]).last_hidden_state[0][:-1]  # h_0 .. h_{T-2}
        e = self.hf.model.embed_tokens(ids[1:])  # tokens 1 .. T-1
        e[0] = 0  # position 0's embedding (vLLM's)
        out = []
        for _ in range(k):
            x = torch.cat([self._norm(e, self.w["enorm.weight"]), self._norm(h, self.w["hnorm.weight"])], -1)
            x = x @ self.w["eh_proj.weight"].T
            n = x.shape[0]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = self.block(x[None], attention_mask=mask, position_ids=pos,
                           position_embeddings=self.rotary(x[None], pos))[0]
            logits = self.hf.lm_head(self._norm(y[-1], self.w["shared_head.norm.weight"]))
            d = int(logits.argmax())
            out.append(d)
            e = torch.cat([e, self.hf.model.embed_tokens(torch.tensor([d]))])
            h = torch.cat([h, y[-1:]])
        return out


def test_drafts_equal_an_independent_reference(ckpts, tmp_path, monkeypatch):
    """Every greedy draft the engine proposes (random MTP weights; batch 4, chunked prefill,
    k = 3) equals the reference's for the request's tokens then: the target's hidden states
    (after the final norm), the embedding-then-hidden order, the position-0 embedding, the
    K/V cache of the layer's entries, each further draft fed its own hidden state."""
    seen = spy_drafts(monkeypatch)
    prompts = random_prompts(4, 4, 30, seed=13)
    llm = _llm(ckpts["random"], max_num_batched_tokens=20, spec={"backoff": False},
               enable_prefix_caching=False)
    _ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    ref = _Reference(ckpts["random"], tmp_path, ckpts["index"])
    assert len(seen) >= 8
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), (len(tokens), drafts)


def test_the_cli_and_json_text_take_method_mtp(ckpts):
    """``--speculative-config '{"method": "mtp", ...}'`` on the command line (serve and
    generate share it) builds the MTP proposer with its k."""
    assert_cli_drafts_exactly(ckpts["exact"], '{"method": "mtp", "num_speculative_tokens": 2}')


def assert_cli_drafts_exactly(model, spec: str) -> None:
    """``serve --speculative-config spec`` (k 2) on ``model`` builds an MTPProposer (MTP's
    or an EAGLE head's) of that k whose drafts a short greedy run accepts every one of."""
    from flashpage.cli import build_llm, build_parser

    args = build_parser().parse_args([
        "serve", "--model", str(model), "--dtype", "float32", "--device", "cpu",
        "--attention-backend", "torch_native", "--speculative-config", spec])
    llm = build_llm(args)
    proposer = llm.engine.proposer
    assert isinstance(proposer, MTPProposer) and proposer.config.num_speculative_tokens == 2
    _ids(llm, random_prompts(2, 5, 9, seed=1))
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_targets_graphs_hand_over_their_hidden_states(ckpts, tmp_path, monkeypatch):
    """fp32 on the GPU, triton backend, the target's decode / prompt-step / piecewise graphs
    captured (and the MTP layer's own: tests/engine/test_mtp_graphs.py): plain decoding's tokens, the exact layer's drafts all
    accepted, and the random layer's every draft equal to the reference's (the hidden
    states the graphs wrote into DecoderStack.hidden_out are the target's)."""
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=64)
    prompts = random_prompts(5, 5, 40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["exact"], mtp=False, **kw), prompts, params)
    llm = _llm(ckpts["exact"], **kw)
    assert llm.engine.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)
    want = _ids(_llm(ckpts["random"], mtp=False, **kw), prompts, params)
    llm = _llm(ckpts["random"], enable_prefix_caching=False, spec={"backoff": False}, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.piecewise is not None
    seen = spy_drafts(monkeypatch)
    assert _ids(llm, prompts, params) == want
    ref = _Reference(ckpts["random"], tmp_path, ckpts["index"])
    assert len(seen) >= 20
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), (len(tokens), drafts)
    _no_leak(llm)


def test_a_request_without_its_last_hidden_state_drafts_nothing_then(ckpts, monkeypatch):
    """Every third step the first request's rows are dropped from the target's layout (as if
    it had missed the last step): its placeholders are cut to none that step (the scheduler's
    tokens and slots for them given back), the layer catches up later, the tokens stay."""
    prompts = random_prompts(3, 6, 20, seed=21)
    want = _ids(_llm(ckpts["exact"], mtp=False), prompts)
    real, calls = MTPProposer.fill, [0]

    def drop(self, out):
        calls[0] += 1
        if calls[0] % 3 == 0 and self.target.last_layout:
            first = self.target.last_layout[0][0]
            self.target.last_layout = [row for row in self.target.last_layout if row[0] is not first]
        real(self, out)
        for req, n in out.scheduled:  # a decode runs its last token and the drafts kept
            if req.num_computed_tokens == req.num_tokens - 1:
                assert n == 1 + len(req.spec_token_ids)

    monkeypatch.setattr(MTPProposer, "fill", drop)
    llm = _llm(ckpts["exact"])
    assert _ids(llm, prompts) == want
    proposer = llm.engine.proposer
    assert isinstance(proposer, MTPProposer) and proposer._skipped > 0
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_on_the_triton_backend(ckpts):
    """The triton backend's kernels (interpreted) and our fused ops for the target and the
    MTP layer's pool: the exact layer has every draft accepted, the tokens are
    torch_native's plain ones."""
    prompts = [random_prompts(1, 4, 4, seed=8)[0], random_prompts(1, 9, 9, seed=9)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = _ids(_llm(ckpts["exact"], mtp=False, block_size=16), prompts, params)
    llm = _llm(ckpts["exact"], attention_backend="triton", block_size=16,
               spec={"num_speculative_tokens": 2})
    assert llm.engine.backend_name == "triton"
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)
