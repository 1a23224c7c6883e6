"""Speculative decoding with Medusa heads (engine/medusa.py, models/medusa.py) over a tiny
Llama target.

The heads are tiny checkpoints in vLLM's Medusa format (config.json with model_type
"medusa", num_heads, num_hidden_layers; ``blocks.{h}.layers.{j}.weight`` / ``.bias``,
``lm_heads.{h}.weight``). CPU, fp32, torch_native: every draft equals an independent
reference's (the target's final hidden states from transformers, the heads written out in
torch); random heads give plain decoding's greedy tokens (batch, chunked prefill, a prefix
hit, preemption, async scheduling) and seeded sampled tokens that do not depend on the batch;
"oracle" heads built to predict a flat target (vocabulary = hidden size, so a linear head
can map each hidden state to any token) have every draft accepted, more than one token a
step; heads that always propose token 0 have next to none accepted, the same tokens;
structured-outputs requests' drafts are cut by their pattern; bad configs are clear errors;
the CLI and benchmarks/spec_decode.py --medusa take the method. GPU (marked gpu): the
target's CUDA graphs hand the heads their states.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError
from flashpage.engine.medusa import MedusaProposer
from tests.conftest import build_tiny_checkpoint, edited_copy, random_prompts

K = 3
HEADS, BLOCKS = 4, 2
H = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _save(path: Path, tensors: dict[str, torch.Tensor], vocab: int, heads: int = HEADS,
          blocks: int = BLOCKS, **extra) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = dict(model_type="medusa", architectures=["MedusaModel"], hidden_size=H,
                  vocab_size=vocab, num_heads=heads, num_hidden_layers=blocks, **extra)
    (path / "config.json").write_text(json.dumps(config))
    return path


def medusa_random(vocab: int, seed: int = 3, heads: int = HEADS, blocks: int = BLOCKS
                  ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for h in range(heads):
        for j in range(blocks):
            t[f"blocks.{h}.layers.{j}.weight"] = 0.2 * torch.randn(H, H, generator=g)
            t[f"blocks.{h}.layers.{j}.bias"] = 0.1 * torch.randn(H, generator=g)
        t[f"lm_heads.{h}.weight"] = 0.2 * torch.randn(vocab, H, generator=g)
    return t


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def medusa_oracle(target: dict[str, torch.Tensor], heads: int = HEADS) -> dict[str, torch.Tensor]:
    """Heads that predict a flat target exactly. The flat target's final hidden state at p
    is X[tok_p] = norm(embed(tok_p)) and its next token f(tok_p) = argmax(lm_head X[tok_p]);
    with a vocabulary of H tokens X is square (and invertible), so head h's lm_head
    L_h = 10 * G_h X^-T, G_h the one-hot map tok -> f^(h+2)(tok), scores exactly 10 at
    token p + 2 + h and 0 elsewhere. The residual blocks add nothing (W = 0, b = 0)."""
    x = _rms(target["model.embed_tokens.weight"].double(), target["model.norm.weight"].double())
    v = x.shape[0]
    assert v == H, "the oracle needs a vocabulary of hidden_size tokens"
    f = (x @ target["lm_head.weight"].double().T).argmax(-1)
    t = {}
    tok = torch.arange(v)
    nxt = f[tok]
    for h in range(heads):
        nxt = f[nxt]  # f^(h + 2)
        g = torch.zeros(v, v, dtype=torch.float64)
        g[nxt, tok] = 10.0
        t[f"lm_heads.{h}.weight"] = torch.linalg.solve(x, g.T).T.float()  # G X^-T
        for j in range(BLOCKS):
            t[f"blocks.{h}.layers.{j}.weight"] = torch.zeros(H, H)
            t[f"blocks.{h}.layers.{j}.bias"] = torch.zeros(H)
    return t


def medusa_fixed(vocab: int) -> dict[str, torch.Tensor]:
    """Heads whose logits are all 0: every draft is token 0 (argmax's first)."""
    t = medusa_random(vocab)
    for h in range(HEADS):
        t[f"lm_heads.{h}.weight"] = torch.zeros(vocab, H)
    return t


def _adds_nothing(t: dict[str, torch.Tensor]) -> None:
    for k in list(t):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = torch.zeros_like(t[k])


def _build(root: Path, **target_kw) -> dict[str, Path]:
    base = build_tiny_checkpoint(root / "base", "llama31_gqa", **target_kw)
    flat = edited_copy(build_tiny_checkpoint(root / "small_vocab", "llama31_gqa", vocab_size=H,
                                             seed=1, **target_kw), root / "flat", _adds_nothing)
    return {
        "base": base, "flat": flat,
        "medusa": _save(root / "m", medusa_random(256), 256),
        "fixed": _save(root / "fixed", medusa_fixed(256), 256),
        "oracle": _save(root / "oracle", medusa_oracle(_weights(flat)), H),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("medusa"))


@pytest.fixture(scope="module")
def gpu_ckpts(tmp_path_factory):
    """ckpts' checkpoints with 2 query heads of 32 over 1 KV head: our Triton kernels on
    CUDA take head_dim 32 up."""
    return _build(tmp_path_factory.mktemp("medusa_gpu"), num_attention_heads=2,
                  num_key_value_heads=1)


def _llm(target: Path, heads: Path | None = None, spec: dict | None = None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8,
          "attention_backend": "torch_native", **kw}
    cfg = None
    if heads is not None:
        cfg = {"method": "medusa", "model": str(heads), "num_speculative_tokens": K, **(spec or {})}
    return LLM(str(target), speculative_config=cfg, **kw)


def _ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(vocab: int = 256) -> list[list[int]]:
    """5 prompts, two sharing a 20-token prefix (a prefix-cache hit)."""
    shared = random_prompts(1, 20, 20, vocab=vocab, seed=9)[0]
    return (random_prompts(3, 5, 40, vocab=vocab, seed=2)
            + [shared + p for p in random_prompts(2, 3, 9, vocab=vocab, seed=4)])


def _no_leak(llm: LLM) -> None:
    assert isinstance(llm.engine.proposer, MedusaProposer)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def spy_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """From now on, each drafting request's tokens and drafts (MedusaProposer.draft_all
    spied), in the order drafted."""
    seen: list[tuple[list[int], list[int]]] = []
    real = MedusaProposer.draft_all

    def spy(self, todo):
        got = real(self, todo)
        seen.extend((list(r.all_token_ids), ds) for (r, _), ds in zip(todo, got, strict=True) if ds)
        return got

    monkeypatch.setattr(MedusaProposer, "draft_all", spy)
    return seen


def reference_drafts(target: Path, heads: Path, tokens: list[int], k: int) -> list[int]:
    """The k drafts after ``tokens``, apart from our code: transformers' final hidden
    state (``last_hidden_state``, after the final norm) at position len - 2, through each
    head written out in torch from the checkpoint's tensors."""
    model = _hf(target)
    with torch.no_grad():
        x = model(torch.tensor([tokens])).last_hidden_state[0, len(tokens) - 2].double()
    w = _weights(heads)
    out = []
    for h in range(k):
        y = x
        for j in range(BLOCKS):
            y = y + F.silu(w[f"blocks.{h}.layers.{j}.weight"].double() @ y
                           + w[f"blocks.{h}.layers.{j}.bias"].double())
        out.append(int((w[f"lm_heads.{h}.weight"].double() @ y).argmax()))
    return out


_HF: dict[Path, transformers.PreTrainedModel] = {}


def _hf(path: Path) -> transformers.PreTrainedModel:
    if path not in _HF:
        _HF[path] = transformers.AutoModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    return _HF[path]


def test_drafts_equal_an_independent_reference(ckpts, monkeypatch):
    """Random heads, batch 5 with chunked prefill: every draft (the first 20 checked) is
    the reference's argmax of each head at the target's state at T - 2."""
    seen = spy_drafts(monkeypatch)
    llm = _llm(ckpts["base"], ckpts["medusa"], max_num_batched_tokens=16, spec={"backoff": False})
    _ids(llm, _prompts())
    assert len(seen) >= 20
    for tokens, drafts in seen[:20]:
        assert len(drafts) == K
        assert drafts == reference_drafts(ckpts["base"], ckpts["medusa"], tokens, K), tokens


def test_greedy_tokens_equal_plain_decoding(ckpts):
    """Random heads (drafts mostly wrong): batch 5, chunked prefill (16-token budget), a
    prefix hit; the tokens are plain decoding's; the counters add up."""
    prompts = _prompts()
    want = _ids(_llm(ckpts["base"]), prompts)
    llm = _llm(ckpts["base"], ckpts["medusa"], max_num_batched_tokens=16, spec={"backoff": False})
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] >= len(prompts) * (GREEDY.max_tokens // (K + 1))
    assert st["num_drafts"] * K >= st["num_draft_tokens"] >= st["num_drafts"] > 0
    assert 0 <= st["num_accepted_tokens"] <= st["num_draft_tokens"]
    assert llm.engine.kv_manager.prefix_hits > 0
    # no K/V pool of the heads' own, no forward of a draft: one batched head call a step
    proposer = llm.engine.proposer
    assert isinstance(proposer, MedusaProposer) and proposer.head_calls > 0
    assert llm.engine.model.model.hidden_out is not None
    _no_leak(llm)


def _count_steps(llm: LLM) -> list[int]:
    """The target's steps run from now on (a one-element counter)."""
    runner = llm.engine.runner
    real = runner.execute
    n = [0]

    def counted(out):
        if out.scheduled:
            n[0] += 1
        return real(out)

    runner.execute = counted  # type: ignore[method-assign]
    return n


def test_oracle_heads_have_every_draft_accepted(ckpts):
    """Heads built to predict the flat target: every draft accepted, more than K tokens a
    checking step on average, and fewer target steps than tokens; the tokens are plain
    decoding's."""
    prompts = _prompts(H)
    plain = _llm(ckpts["flat"], max_num_seqs=1)
    plain_steps = _count_steps(plain)
    want = _ids(plain, prompts)
    llm = _llm(ckpts["flat"], ckpts["oracle"], max_num_seqs=1)
    steps = _count_steps(llm)
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    assert st["mean_accepted_length"] > K, st
    # one request at a time: plain decoding takes a step a token (after the prompt's);
    # with every draft accepted a step emits up to K + 1
    assert plain_steps[0] >= len(prompts) * GREEDY.max_tokens
    assert steps[0] <= len(prompts) * (1 + -(-GREEDY.max_tokens // (K + 1))), steps
    _no_leak(llm)


def test_heads_always_proposing_one_token_are_rejected(ckpts, monkeypatch):
    """Heads whose every draft is token 0: next to none accepted, the same tokens."""
    prompts = _prompts()
    want = _ids(_llm(ckpts["base"]), prompts)
    seen = spy_drafts(monkeypatch)
    bad = _llm(ckpts["base"], ckpts["fixed"], spec={"backoff": False})
    assert _ids(bad, prompts) == want
    assert seen and all(d == [0] * len(d) for _, d in seen)
    st = bad.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] >= len(prompts) * (GREEDY.max_tokens // (K + 1))
    assert st["acceptance_rate"] < 0.05, st
    _no_leak(bad)


def test_preemption_and_async_scheduling_keep_the_tokens(ckpts):
    """A cache too small for every request (preemptions: the drafting request's state
    recomputed), then async scheduling with the back-off on (random heads: requests back
    off and the engine goes async between): plain decoding's tokens each time."""
    prompts = random_prompts(6, 10, 30, vocab=H, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["flat"]), prompts, params)
    llm = _llm(ckpts["flat"], ckpts["oracle"], block_size=4, num_gpu_blocks=40,
               max_num_batched_tokens=32)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0
    _no_leak(llm)
    prompts = random_prompts(6, 10, 30, seed=4)
    want = _ids(_llm(ckpts["base"]), prompts, params)
    llm = _llm(ckpts["base"], ckpts["medusa"], async_scheduling=True, block_size=4,
               num_gpu_blocks=40, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0
    _no_leak(llm)
    # the finished requests' back-off state is forgotten at the next step (Medusa keeps no
    # n-gram arrays, whose clean-up forgot it before)
    proposer = llm.engine.proposer
    assert proposer is not None and proposer.backoff is not None and proposer.backoff._state
    llm.engine.step()
    assert not proposer.backoff._state


def test_sampled_requests_are_seeded(ckpts):
    """Seeded sampled requests draw from streams keyed by their seed and output position:
    the same tokens run after run and whatever shares the batch; the oracle's drafts are
    still accepted often (a low temperature keeps the target near its argmax)."""
    prompts = random_prompts(4, 5, 20, vocab=H, seed=11)
    seeded = SamplingParams(temperature=0.3, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    llm = _llm(ckpts["flat"], ckpts["oracle"])
    alone = _ids(llm, prompts[:1], seeded)[0]
    again = _ids(_llm(ckpts["flat"], ckpts["oracle"]), prompts[:1], seeded)[0]
    batch = [o.outputs[0].token_ids for o in
             llm.generate(prompts, [seeded, other, other, other], use_tqdm=False)]
    assert batch[0] == alone == again
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["num_accepted_tokens"] > 0, st
    _no_leak(llm)


def test_logprobs_with_medusa_drafts(ckpts):
    """Logprobs come with every token, drafted or not, and equal plain decoding's."""
    prompts = random_prompts(3, 5, 20, vocab=H, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = _llm(ckpts["flat"]).generate(prompts, params, use_tqdm=False)
    llm = _llm(ckpts["flat"], ckpts["oracle"])
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    for a, b in zip(plain, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None and len(la) == len(lb) == 12
        for x, y in zip(la, lb, strict=True):
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top, strict=True))


def test_config_errors(ckpts, tmp_path):
    """No model, a folder without config.json, another model_type, a hidden or vocabulary
    size other than the target's, more drafts than heads, a missing or misshapen tensor:
    each a clear error naming it."""
    with pytest.raises(ValueError, match="method 'medusa' needs model: the Medusa heads' folder"):
        LLM(str(ckpts["base"]), speculative_config={"method": "medusa"}, device="cpu")
    with pytest.raises(ValueError, match="method 'medusa' needs model"):
        _llm(ckpts["base"], tmp_path)
    other = edited_copy(ckpts["medusa"], tmp_path / "other", None,
                        lambda c: c.update(model_type="llama"))
    with pytest.raises(ConfigError, match="model_type 'llama', not 'medusa'"):
        _llm(ckpts["base"], other)
    wide = edited_copy(ckpts["medusa"], tmp_path / "wide", None, lambda c: c.update(hidden_size=128))
    with pytest.raises(ConfigError, match="hidden_size 128 differs from the target's 64"):
        _llm(ckpts["base"], wide)
    with pytest.raises(ConfigError, match="vocab_size 64 differs from the target's 256"):
        _llm(ckpts["base"], ckpts["oracle"])
    with pytest.raises(ConfigError, match=r"num_speculative_tokens 5 is more than the "
                                          r"checkpoint's num_heads 4"):
        _llm(ckpts["base"], ckpts["medusa"], spec={"num_speculative_tokens": 5})
    noheads = edited_copy(ckpts["medusa"], tmp_path / "noheads", None,
                          lambda c: c.pop("num_heads"))
    with pytest.raises(ConfigError, match="has no num_heads / medusa_num_heads"):
        _llm(ckpts["base"], noheads)
    gone = edited_copy(ckpts["medusa"], tmp_path / "gone",
                       lambda t: [t.pop(k) for k in ("lm_heads.1.weight", "blocks.2.layers.1.bias")])
    with pytest.raises(ConfigError, match=r"2 weight\(s\) of the Medusa heads missing") as e:
        _llm(ckpts["base"], gone)
    assert "lm_heads.1.weight" in str(e.value) and "blocks.2.layers.1.bias" in str(e.value)
    bent = edited_copy(ckpts["medusa"], tmp_path / "bent",
                       lambda t: t.update({"blocks.0.layers.0.weight": torch.zeros(H, H + 1)}))
    with pytest.raises(ConfigError, match=r"blocks.0.layers.0.weight has shape \(64, 65\), "
                                          r"expected \(64, 64\)"):
        _llm(ckpts["base"], bent)
    with pytest.raises(ValueError, match="speculative_config model is for method 'draft_model'"):
        _llm(ckpts["base"], ckpts["medusa"], spec={"method": "ngram"})


def test_the_original_release_names_and_fewer_heads_drafted(ckpts, tmp_path):
    """config.json with the original release's medusa_num_heads / medusa_num_layers and
    tensors under a leading ``model.``, drafting 2 of its 4 heads: the same drafts (the
    first 2 of each) as the first checkpoint's."""
    renamed = edited_copy(
        ckpts["medusa"], tmp_path / "renamed",
        lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t)}),
        lambda c: c.update(medusa_num_heads=c.pop("num_heads"),
                           medusa_num_layers=c.pop("num_hidden_layers")))
    prompts = random_prompts(3, 5, 20, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a = _llm(ckpts["base"], ckpts["medusa"], spec={"backoff": False})
    b = _llm(ckpts["base"], renamed, spec={"backoff": False, "num_speculative_tokens": 2})
    assert _ids(a, prompts, params) == _ids(b, prompts, params)
    pa, pb = a.engine.proposer, b.engine.proposer
    assert isinstance(pa, MedusaProposer) and isinstance(pb, MedusaProposer)
    assert pb.heads is not None and len(pb.heads.lm_heads) == 2
    x = torch.randn(5, H)
    assert pa.heads is not None
    assert torch.equal(pa.heads(x)[:2], pb.heads(x))


def test_the_cli_takes_method_medusa(ckpts):
    """``serve --speculative-config`` with method medusa (k 2) builds a MedusaProposer
    whose oracle drafts a short greedy run accepts every one of."""
    from flashpage.cli import build_llm, build_parser

    spec = json.dumps({"method": "medusa", "model": str(ckpts["oracle"]),
                       "num_speculative_tokens": 2})
    args = build_parser().parse_args([
        "serve", "--model", str(ckpts["flat"]), "--dtype", "float32", "--device", "cpu",
        "--attention-backend", "torch_native", "--speculative-config", spec])
    llm = build_llm(args)
    proposer = llm.engine.proposer
    assert isinstance(proposer, MedusaProposer) and proposer.config.num_speculative_tokens == 2
    _ids(llm, random_prompts(2, 5, 9, vocab=H, seed=1))
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_with_cuda_graphs(gpu_ckpts, monkeypatch):
    """fp32 on the GPU, triton backend, the target's graphs captured (decode, prompt-step,
    piecewise: they write the states the heads read; the heads run eagerly): plain
    decoding's tokens, the oracle's drafts all accepted, the random heads' drafts equal to
    the reference's."""
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(5, 5, 40, vocab=H, seed=6)
    want = _ids(_llm(gpu_ckpts["flat"], **kw), prompts, params)
    llm = _llm(gpu_ckpts["flat"], gpu_ckpts["oracle"], **kw)
    assert llm.engine.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)
    prompts = random_prompts(5, 5, 40, seed=6)
    want = _ids(_llm(gpu_ckpts["base"], **kw), prompts, params)
    llm = _llm(gpu_ckpts["base"], gpu_ckpts["medusa"], enable_prefix_caching=False,
               spec={"backoff": False}, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.piecewise is not None
    seen = spy_drafts(monkeypatch)
    assert _ids(llm, prompts, params) == want
    assert len(seen) >= 20
    for tokens, drafts in seen[:20]:
        got = reference_drafts(gpu_ckpts["base"], gpu_ckpts["medusa"], tokens, K)
        assert drafts == got, tokens
    _no_leak(llm)


def test_the_benchmarks_medusa_modes(tmp_path):
    """benchmarks/spec_decode.py --medusa on a tiny counting target (CPU): the right heads'
    drafts all accepted, in fewer steps than plain decoding; the wrong ones' none; both
    plain decoding's tokens."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "spec.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "spec_decode.py"), "--config",
                    str(tmp_path / "config.json"), "--device", "cpu", "--dtype", "float32",
                    "--batch-sizes", "2", "--ks", "3", "--input-len", "32", "--output-len", "24",
                    "--iters", "1", "--medusa", "--json-out", str(out)],
                   check=True, cwd=root, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(root)})
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    right, wrong, plain = runs["medusa k=3"], runs["medusa-wrong k=3"], runs["plain"]
    assert right["same_tokens"] == wrong["same_tokens"] == 2
    assert right["spec"]["num_draft_tokens"] > 0 and right["spec"]["acceptance_rate"] == 1.0
    assert right["steps"] < plain["steps"] / 2
    assert wrong["spec"]["num_draft_tokens"] > 0 and wrong["spec"]["num_accepted_tokens"] == 0


def test_structured_outputs_with_medusa_drafts(byte_model_dir, tmp_path, monkeypatch):
    """A JSON-schema request's Medusa drafts are cut where its pattern would refuse one (no
    draft it forbids is run): greedy tokens are plain guided decoding's; sampled outputs
    still match the schema."""
    from flashpage import StructuredOutputsParams
    from tests.byte_tokenizer import VOCAB_SIZE

    heads = _save(tmp_path / "byte_heads", medusa_random(VOCAB_SIZE, seed=8), VOCAB_SIZE)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    guided = StructuredOutputsParams(json=schema)
    prompts = ["the quick brown fox", '{"name": "Ada", "age": 36}']
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=guided)
    want = _llm(byte_model_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
    seen = spy_drafts(monkeypatch)
    llm = _llm(byte_model_dir, heads, spec={"backoff": False}, max_model_len=256)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    for g in got:
        out = json.loads(g.outputs[0].text)
        assert set(out) == {"name", "age"} and isinstance(out["age"], int)
    st = llm.engine.stats()["spec_decode"]
    assert len(seen) > 0, "the heads drafted for the guided requests"
    assert st["num_draft_tokens"] < sum(len(d) for _, d in seen), "the pattern cut some drafts"
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=guided)
    for o in llm.generate(prompts * 2, sampled, use_tqdm=False):
        assert set(json.loads(o.outputs[0].text)) == {"name", "age"}
    _no_leak(llm)


def test_draft_all_reads_the_row_of_position_t_minus_2(ckpts):
    """draft_all over a made-up last step: a request whose tokens sat at rows 3 .. 6
    (positions 5 .. 8) with 9 tokens now drafts from row 3 + (7 - 5) = 5, its room
    honoured; one absent from the step, and one whose T - 2 is not among its positions
    there, draft nothing (counted as skipped)."""
    from types import SimpleNamespace

    from flashpage.engine.spec_decode import SpeculativeConfig
    from flashpage.models.loader import resolve_model
    from flashpage.models.medusa import load_medusa, read_medusa_spec

    target_cfg = resolve_model(str(ckpts["base"])).config
    spec = read_medusa_spec(str(ckpts["medusa"]), target_cfg, K)
    heads = load_medusa(spec, K, torch.float32, torch.device("cpu"))
    states = torch.randn(10, H)
    a, b, c = (SimpleNamespace(request_id=r, num_tokens=n) for r, n in (("a", 9), ("b", 4), ("c", 20)))
    runner = SimpleNamespace(last_layout=[(a, 3, 5, 4), (c, 7, 0, 3)])
    prop = MedusaProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=K), 512,
                          heads=heads, target=runner, hidden_states=states)  # type: ignore[arg-type]
    got = prop.draft_all([(a, 2), (b, K), (c, K)])  # type: ignore[list-item]
    want = heads(states[5:6])[:, 0].argmax(-1).tolist()
    assert got == [want[:2], [], []] and len(want) == K
    assert prop.skipped == 2 and prop.head_calls == 1
