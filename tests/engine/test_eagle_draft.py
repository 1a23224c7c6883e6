"""Speculative decoding with EAGLE-1 and EAGLE-3 heads (engine/eagle.py, models/eagle.py) over a
tiny Llama target (8 layers: EAGLE-3 reads the streams entering layers 2, 4 and 5).

The heads are tiny random checkpoints under the published tensor names (EAGLE-1: fc with a
bias, layers.0.* without input_layernorm, no norm; EAGLE-3: fc over three states,
midlayer.* with hidden_norm and 2H-wide q/k/v, norm, its own lm_head over a reduced
vocabulary with d2t / t2d). CPU, fp32, torch_native: every greedy draft equals an
independent pure-torch reference's (the target's states from transformers); greedy tokens
equal plain decoding's (batch, chunked prefill, preemption, async scheduling); a head built
to predict the target exactly has every draft accepted (and one fed the wrong half, not);
bad configs are clear errors; the CLI takes the methods (MoE and quantized targets:
test_eagle_targets.py). GPU (marked gpu): the target's
CUDA graphs hand the head their states and the head's own graphs replay.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError
from flashpage.engine.mtp import MTPProposer
from tests.conftest import (
    build_tiny_checkpoint,
    build_tiny_moe_checkpoint,
    edited_copy,
    random_prompts,
)
from tests.engine.test_mtp_draft import _no_leak, assert_cli_drafts_exactly, spy_drafts

K = 3
H, V, LAYERS = 64, 256, 8
AUX = (2, 4, 5)  # 2, L // 2, L - 3
DRAFT_VOCAB = 200
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _save(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _config(method: str, heads: int = 4, kv_heads: int = 2, **extra) -> dict:
    c = dict(hidden_size=H, intermediate_size=96, num_attention_heads=heads,
             num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=V, rms_norm_eps=1e-6,
             max_position_embeddings=512, rope_theta=10000.0)
    if method == "eagle3":
        c.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    else:
        c.update(architectures=["LlamaForCausalLM"], bias=True)
    c.update(extra)
    return c


def _layer(prefix: str, g: torch.Generator, heads: int = 4, kv_heads: int = 2, width: int = H,
           input_norm: bool = True) -> dict[str, torch.Tensor]:
    d = H // heads

    def r(*shape):
        return 0.2 * torch.randn(*shape, generator=g)

    t = {f"{prefix}self_attn.q_proj.weight": r(heads * d, width),
         f"{prefix}self_attn.k_proj.weight": r(kv_heads * d, width),
         f"{prefix}self_attn.v_proj.weight": r(kv_heads * d, width),
         f"{prefix}self_attn.o_proj.weight": r(H, heads * d),
         f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         f"{prefix}mlp.gate_proj.weight": r(96, H), f"{prefix}mlp.up_proj.weight": r(96, H),
         f"{prefix}mlp.down_proj.weight": r(H, 96)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return t


def eagle1_random(seed: int = 3, heads: int = 4, kv_heads: int = 2) -> dict[str, torch.Tensor]:
    """The original EAGLE-1 layout: fc (with a bias), layers.0.* without input_layernorm,
    no norm (the target's lm_head reads the layer's output as it is)."""
    g = torch.Generator().manual_seed(seed)
    t = _layer("layers.0.", g, heads=heads, kv_heads=kv_heads, input_norm=False)
    t["fc.weight"] = 0.15 * torch.randn(H, 2 * H, generator=g)
    t["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    return t


def _vocab_map(n: int, seed: int) -> torch.Tensor:
    """n target ids, increasing (as the published d2t's: the frequent tokens in id order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(V, generator=g)[:n].sort().values


def eagle3_random(seed: int = 4, heads: int = 4, kv_heads: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = _layer("midlayer.", g, heads=heads, kv_heads=kv_heads, width=2 * H)
    t["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    t["fc.weight"] = 0.1 * torch.randn(H, 3 * H, generator=g)
    t["norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    t["lm_head.weight"] = 0.2 * torch.randn(DRAFT_VOCAB, H, generator=g)
    ids = _vocab_map(DRAFT_VOCAB, seed)
    t["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    return t


def _target_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def eagle1_exact(target: dict[str, torch.Tensor], swap: bool = False, heads: int = 4,
                 kv_heads: int = 2) -> dict[str, torch.Tensor]:
    """For a target whose layers add nothing (its next token f(token)): fc = [I | 0] reads
    the embedding alone, the layer adds nothing, norm is the target's final norm: the head
    predicts f(token p + 1) = token p + 2 exactly. ``swap``: fc = [0 | I] reads the target's
    hidden state instead and predicts token p + 1 (mostly wrong)."""
    t = eagle1_random(5, heads, kv_heads)
    t["layers.0.self_attn.o_proj.weight"].zero_()
    t["layers.0.mlp.down_proj.weight"].zero_()
    eye, zero = torch.eye(H), torch.zeros(H, H)
    t["fc.weight"] = torch.cat([zero, eye] if swap else [eye, zero], dim=1)
    t["fc.bias"] = torch.zeros(H)
    t["norm.weight"] = target["model.norm.weight"].clone()
    return t


def eagle3_exact(target: dict[str, torch.Tensor], seed: int = 6) -> dict[str, torch.Tensor]:
    """For a target whose layers add nothing: fc = 0 (the first g is 0); one head of 64
    whose q = k = c * input_layernorm(embedding) attends to its own position alone (the
    largest q.k by far), v = normed embedding - hidden_norm(g), o = I: y = g + attn =
    the normed embedding of the token fed (rms 1, so hidden_norm(y) = y at the next step);
    its norm and lm_head are the target's final norm and lm_head under a permuted draft
    vocabulary (d2t): it predicts f(token p + 1) exactly."""
    g = torch.Generator().manual_seed(seed)
    t = _layer("midlayer.", g, heads=1, kv_heads=1, width=2 * H)
    eye, zero, c = torch.eye(H), torch.zeros(H, H), 12.0
    t["midlayer.self_attn.q_proj.weight"] = c * torch.cat([eye, zero], dim=1)
    t["midlayer.self_attn.k_proj.weight"] = c * torch.cat([eye, zero], dim=1)
    t["midlayer.self_attn.v_proj.weight"] = torch.cat([eye, -eye], dim=1)
    t["midlayer.self_attn.o_proj.weight"] = eye.clone()
    t["midlayer.mlp.down_proj.weight"].zero_()
    t["midlayer.input_layernorm.weight"] = torch.ones(H)
    t["midlayer.hidden_norm.weight"] = torch.ones(H)
    t["fc.weight"] = torch.zeros(H, 3 * H)
    t["norm.weight"] = target["model.norm.weight"].clone()
    perm = torch.randperm(V, generator=g)  # draft id i -> target id perm[i]
    t["lm_head.weight"] = target["lm_head.weight"][perm].clone()
    t["d2t"] = perm - torch.arange(V)
    t["t2d"] = torch.ones(V, dtype=torch.bool)
    return t


def _adds_nothing(t: dict[str, torch.Tensor]) -> None:
    for k in list(t):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = torch.zeros_like(t[k])


def _heads_over(base: Path, root: Path, heads: int = 4, kv_heads: int = 2) -> dict[str, Path]:
    """The target ``base``, its flat twin (attention and MLP / every expert's output zeroed:
    next token f(token)) and heads for both under ``root``: random EAGLE-1 / EAGLE-3 ones of
    ``heads`` query heads over ``kv_heads``, exact ones (EAGLE-3's of one head of 64)."""
    flat = edited_copy(base, root / "flat", _adds_nothing)
    tw = _target_weights(flat)
    narrow = dict(heads=heads, kv_heads=kv_heads)
    return {
        "base": base, "flat": flat,
        "eagle": _save(root / "e1", eagle1_random(**narrow), _config("eagle", **narrow)),
        "eagle3": _save(root / "e3", eagle3_random(**narrow), _config("eagle3", **narrow)),
        "eagle_exact": _save(root / "e1x", eagle1_exact(tw, **narrow), _config("eagle", **narrow)),
        "eagle_swapped": _save(root / "e1s", eagle1_exact(tw, swap=True, **narrow),
                               _config("eagle", **narrow)),
        "eagle3_exact": _save(root / "e3x", eagle3_exact(tw),
                              _config("eagle3", heads=1, kv_heads=1, draft_vocab_size=V)),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return _heads_over(build_tiny_checkpoint(root / "base", "llama31_gqa", num_hidden_layers=LAYERS),
                       root)


def _moe_ckpts(root: Path, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> dict[str, Path]:
    """_heads_over a Qwen3-MoE target of 8 layers (H 64, vocab V: the heads' shapes)."""
    base = build_tiny_moe_checkpoint(root / "base", "qwen3_moe", num_hidden_layers=LAYERS,
                                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     head_dim=head_dim)
    return _heads_over(base, root, heads, kv_heads)


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    return _moe_ckpts(tmp_path_factory.mktemp("eagle_moe"))


@pytest.fixture(scope="module")
def gpu_ckpts(tmp_path_factory):
    """ckpts' checkpoints with heads of 32 (target and EAGLE-1 heads: 2 query heads, 1 KV
    head) and 64 (the EAGLE-3 ones' 1): our Triton kernels on CUDA take head_dim 32 up."""
    root = tmp_path_factory.mktemp("eagle_gpu")
    base = build_tiny_checkpoint(root / "base", "llama31_gqa", num_hidden_layers=LAYERS,
                                 num_attention_heads=2, num_key_value_heads=1)
    return _heads_over(base, root, heads=2, kv_heads=1)


def _llm(target: Path, head: Path | None = None, method: str = "eagle", spec: dict | None = None,
         **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8,
          "attention_backend": "torch_native", **kw}
    cfg = None
    if head is not None:
        cfg = {"method": method, "model": str(head), "num_speculative_tokens": K, **(spec or {})}
    return LLM(str(target), speculative_config=cfg, **kw)


def _ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


class _Reference:
    """The EAGLE heads computed apart from our code: the target's states from transformers
    (EAGLE-1: ``last_hidden_state``, after the final norm; EAGLE-3: the inputs of layers 2,
    4, 5, caught by forward pre-hooks) and the head written out in torch from the
    checkpoint's tensors (its own rotary, causal attention, GQA). ``drafts(tokens, k)``: the
    k greedy drafts after ``tokens`` (entry p reads the state at p and token p + 1; draft 1
    from the entry at len - 2; each further one fed the last draft and the head's own
    output y at the entry before)."""

    def __init__(self, target: Path, head: Path, method: str) -> None:
        from safetensors.torch import load_file

        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            target, dtype=torch.float32, attn_implementation="eager")
        w = load_file(str(head / "model.safetensors"))
        self.w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
        self.cfg = json.loads((head / "config.json").read_text())
        self.eagle3 = method == "eagle3"
        self.eps = self.cfg["rms_norm_eps"]

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _states(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.eagle3:
            return self.hf.model(ids[None]).last_hidden_state[0]
        caught: dict[int, torch.Tensor] = {}
        hooks = [self.hf.model.layers[i].register_forward_pre_hook(
            lambda m, a, kw, i=i: caught.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
            with_kwargs=True) for i in AUX]
        try:
            self.hf.model(ids[None])
        finally:
            for hk in hooks:
                hk.remove()
        return torch.cat([caught[i] for i in AUX], -1) @ self.w["fc.weight"].T

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def _layer(self, e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The head over entries (embedding e_i, state g_i) at positions 0 .. n - 1 -> y [n, H]."""
        w, p = self.w, "layers.0."
        if self.eagle3:
            r = g
            z = torch.cat([self._norm(e, w[p + "input_layernorm.weight"]),
                           self._norm(g, w[p + "hidden_norm.weight"])], -1)
        else:
            r = torch.cat([e, g], -1) @ w["fc.weight"].T + w["fc.bias"]
            z = r  # no input_layernorm in the original EAGLE-1 layer
        n = z.shape[0]
        heads, kv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        d = H // heads
        q = (z @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
        k = (z @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d)
        v = (z @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
        pos = torch.arange(n)
        q, k = self._rope(q, pos), self._rope(k, pos)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, heads * d)
        r = r + o @ w[p + "self_attn.o_proj.weight"].T
        x = self._norm(r, w[p + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
             * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return r + m

    def _pick(self, y: torch.Tensor) -> int:
        if not self.eagle3:
            return int(self.hf.lm_head(y).argmax())
        i = int((self._norm(y, self.w["norm.weight"]) @ self.w["lm_head.weight"].T).argmax())
        return i + int(self.w["d2t"][i])  # draft id -> target id

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor(tokens)
        g = self._states(ids)[:-1]  # states 0 .. T - 2
        e = self.hf.model.embed_tokens(ids[1:])  # tokens 1 .. T - 1
        out = []
        for _ in range(k):
            y = self._layer(e, g)
            d = self._pick(y[-1])
            out.append(d)
            e = torch.cat([e, self.hf.model.embed_tokens(torch.tensor([d]))])
            g = torch.cat([g, y[-1:]])
        return out


def assert_drafts_are_the_references(seen: list, ckpts: dict[str, Path], method: str,
                                     at_least: int) -> None:
    """Every (tokens, drafts) ``spy_drafts`` saw (at least ``at_least``) equals the
    reference's drafts for the random ``method`` head over ckpts["base"]."""
    ref = _Reference(ckpts["base"], ckpts[method], method)
    assert len(seen) >= at_least
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), (len(tokens), drafts)


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_an_independent_reference(request, monkeypatch, method, target):
    """Every greedy draft the engine proposes (random heads; batch 4, chunked prefill, k = 3)
    equals the reference's for the request's tokens then, and the tokens are plain
    decoding's; over the dense target and the Qwen3-MoE one (the routed layers' states
    from transformers)."""
    ckpts = request.getfixturevalue("ckpts" if target == "dense" else "moe_ckpts")
    prompts = random_prompts(4, 4, 30, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = _ids(_llm(ckpts["base"]), prompts, params)
    seen = spy_drafts(monkeypatch)
    llm = _llm(ckpts["base"], ckpts[method], method, max_num_batched_tokens=20,
               spec={"backoff": False}, enable_prefix_caching=False)
    assert _ids(llm, prompts, params) == want
    assert_drafts_are_the_references(seen, ckpts, method, 8)
    if method == "eagle3":  # every draft from the reduced vocabulary, as target ids
        allowed = set(_vocab_map(DRAFT_VOCAB, 4).tolist())
        assert all(set(d) <= allowed for _, d in seen)
    _no_leak(llm)


def _prompts() -> list[list[int]]:
    """5 prompts, two sharing a 20-token prefix (a prefix-cache hit in both pools)."""
    shared = random_prompts(1, 20, 20, seed=9)[0]
    return random_prompts(3, 5, 40, seed=2) + [shared + p for p in random_prompts(2, 3, 9, seed=4)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_tokens_equal_plain_decoding(ckpts, method):
    """Random heads (drafts mostly wrong): batch 5, chunked prefill (16-token budget), a
    prefix hit; the tokens are plain decoding's; the counters add up."""
    prompts = _prompts()
    want = _ids(_llm(ckpts["base"]), prompts)
    llm = _llm(ckpts["base"], ckpts[method], method, max_num_batched_tokens=16,
               spec={"backoff": False})
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] >= len(prompts) * (GREEDY.max_tokens // (K + 1))
    assert st["num_drafts"] * K >= st["num_draft_tokens"] >= st["num_drafts"] > 0
    assert 0 <= st["num_accepted_tokens"] <= st["num_draft_tokens"]
    assert llm.engine.kv_manager.prefix_hits > 0
    _no_leak(llm)


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_exact_head_has_every_draft_accepted(request, method, target):
    """A head built to predict the flat target (dense, or MoE: every expert's output
    zeroed) exactly: every draft accepted, more than K tokens a checking step on average;
    the tokens are plain decoding's."""
    ckpts = request.getfixturevalue("ckpts" if target == "dense" else "moe_ckpts")
    prompts = _prompts()
    want = _ids(_llm(ckpts["flat"]), prompts)
    llm = _llm(ckpts["flat"], ckpts[f"{method}_exact"], method, max_num_batched_tokens=24)
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    assert st["mean_accepted_length"] > K
    _no_leak(llm)


def test_the_wrong_half_of_fc_is_mostly_rejected(ckpts):
    """EAGLE-1's exact head with fc reading the target's hidden state instead of the
    embedding predicts the NEXT token, not the one after: mostly rejected, the same tokens."""
    prompts = _prompts()
    want = _ids(_llm(ckpts["flat"]), prompts)
    bad = _llm(ckpts["flat"], ckpts["eagle_swapped"], spec={"backoff": False})
    assert _ids(bad, prompts) == want
    st = bad.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] < 0.5, st


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_preemption_and_async_scheduling_keep_the_tokens(ckpts, method):
    """A cache too small for every request (preemptions: both pools' blocks freed, the
    head's entries recomputed), then async scheduling with the back-off on (random head:
    requests back off, positions held): plain decoding's tokens each time."""
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["flat"]), prompts, params)
    llm = _llm(ckpts["flat"], ckpts[f"{method}_exact"], method, block_size=4, num_gpu_blocks=40,
               max_num_batched_tokens=32)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0
    _no_leak(llm)
    want = _ids(_llm(ckpts["base"]), prompts, params)
    llm = _llm(ckpts["base"], ckpts[method], method, async_scheduling=True, block_size=4,
               num_gpu_blocks=40, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0
    _no_leak(llm)


def test_sampled_requests_are_seeded(ckpts, monkeypatch):
    """Sampled requests draw drafts from the head's q: a seed gives the same tokens twice;
    the exact head's drafts are still accepted often; the random EAGLE-3 head's sampled
    drafts are all from its reduced vocabulary (no probability outside it)."""
    prompts = random_prompts(3, 5, 20, seed=11)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = _ids(_llm(ckpts["flat"], ckpts["eagle3_exact"], "eagle3"), prompts, params)
    llm = _llm(ckpts["flat"], ckpts["eagle3_exact"], "eagle3")
    assert _ids(llm, prompts, params) == a
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["num_accepted_tokens"] > 0
    _no_leak(llm)
    seen = spy_drafts(monkeypatch)
    params = SamplingParams(temperature=1.5, max_tokens=16, seed=3, ignore_eos=True)
    llm = _llm(ckpts["base"], ckpts["eagle3"], "eagle3", spec={"backoff": False})
    _ids(llm, prompts, params)
    allowed = set(_vocab_map(DRAFT_VOCAB, 4).tolist())
    assert len(seen) >= 5 and all(set(d) <= allowed for _, d in seen)
    _no_leak(llm)


def test_without_eagle_the_target_keeps_nothing(ckpts):
    """A run without EAGLE leaves the target's stack on its plain loop (nothing kept); with
    EAGLE-3 the stack keeps the three layers' streams, with EAGLE-1 its final states."""
    plain = _llm(ckpts["base"])
    stack = plain.engine.model.model
    assert stack.aux_out is None and stack.hidden_out is None
    e3 = _llm(ckpts["base"], ckpts["eagle3"], "eagle3").engine.model.model
    assert e3.aux_layers == AUX and e3.aux_out is not None and e3.aux_out.shape[1] == 3 * H
    assert e3.hidden_out is None
    e1 = _llm(ckpts["base"], ckpts["eagle"]).engine.model.model
    assert e1.aux_out is None and e1.hidden_out is not None


def test_config_errors(ckpts, tmp_path):
    """No model, a folder without config.json, a hidden size other than the target's, a
    missing tensor, the other method's checkpoint, a target too shallow for EAGLE-3: each
    a clear error naming it (a target not of the Llama body: test_eagle_targets.py)."""
    with pytest.raises(ValueError, match="method 'eagle' needs model"):
        LLM(str(ckpts["base"]), speculative_config={"method": "eagle"}, device="cpu")
    with pytest.raises(ValueError, match="method 'eagle3' needs model"):
        LLM(str(ckpts["base"]), speculative_config={"method": "eagle3", "model": str(tmp_path)},
            device="cpu")
    wide = edited_copy(ckpts["eagle"], tmp_path / "wide", None, lambda c: c.update(hidden_size=128))
    with pytest.raises(ConfigError, match="hidden_size 128 differs from the target's 64"):
        _llm(ckpts["base"], wide)
    gone = edited_copy(ckpts["eagle3"], tmp_path / "gone",
                       lambda t: [t.pop(k) for k in ("d2t", "midlayer.hidden_norm.weight")])
    with pytest.raises(ConfigError, match=r"2 weight\(s\) of the EAGLE head missing") as e:
        _llm(ckpts["base"], gone, "eagle3")
    assert "d2t" in str(e.value) and "layers.0.hidden_norm.weight" in str(e.value)
    with pytest.raises(ConfigError, match="use method 'eagle3'"):
        _llm(ckpts["base"], ckpts["eagle3"], "eagle")
    with pytest.raises(ConfigError, match="an EAGLE-1 checkpoint"):
        _llm(ckpts["base"], ckpts["eagle"], "eagle3")
    nobias = edited_copy(ckpts["eagle"], tmp_path / "nobias", None, lambda c: c.update(bias=False))
    with pytest.raises(ConfigError, match="fc.bias have no place in the EAGLE head"):
        _llm(ckpts["base"], nobias)
    shallow = build_tiny_checkpoint(tmp_path / "shallow", "llama31_gqa", num_hidden_layers=2)
    with pytest.raises(ConfigError, match="EAGLE-3 reads three target layers"):
        _llm(shallow, ckpts["eagle3"], "eagle3")


def test_the_other_published_names_load_the_same_head(ckpts, tmp_path):
    """EAGLE-3 tensors under ``model.layers.0.*`` (a leading ``model.``, ``layers.0.`` for
    ``midlayer.``) or in a pytorch_model.bin, and EAGLE-1's with an lm_head copy equal to
    the target's: the same tokens and drafts as the published layout."""
    prompts = random_prompts(3, 5, 20, seed=3)

    def renamed(t):
        for k in list(t):
            t["model." + k.replace("midlayer.", "layers.0.")] = t.pop(k)

    other = edited_copy(ckpts["eagle3"], tmp_path / "e3", renamed)
    # the released EAGLE-3 heads are pytorch_model.bin files
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((ckpts["eagle3"] / "config.json").read_text())
    torch.save(_target_weights(ckpts["eagle3"]), binary / "pytorch_model.bin")
    a = _llm(ckpts["base"], ckpts["eagle3"], "eagle3", spec={"backoff": False})
    want = _ids(a, prompts)
    for folder in (other, binary):
        b = _llm(ckpts["base"], folder, "eagle3", spec={"backoff": False})
        assert _ids(b, prompts) == want
        assert a.engine.stats()["spec_decode"] == b.engine.stats()["spec_decode"]
    head = _target_weights(ckpts["base"])["lm_head.weight"]
    copy = edited_copy(ckpts["eagle"], tmp_path / "e1", lambda t: t.update({"lm_head.weight": head}))
    c = _llm(ckpts["base"], ckpts["eagle"], spec={"backoff": False})
    d = _llm(ckpts["base"], copy, spec={"backoff": False})
    assert _ids(c, prompts) == _ids(d, prompts)
    assert c.engine.stats()["spec_decode"] == d.engine.stats()["spec_decode"]
    assert d.engine.mtp is not None and d.engine.mtp.lm_head is None


@pytest.mark.parametrize("which", ["random", "exact"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_graph_forwards_draft_as_the_eager_head(ckpts, monkeypatch, method, which):
    """The head's decode and catch-up graphs (MTPRunner's, set up uncaptured: the CPU runs
    their padded static-buffer forwards eagerly; EAGLE-3's fc applied before the copy into
    the static buffer): batch 5 padded to 8, max_tokens ending mid-step; every draft the
    eager head's (random heads draft from the hidden states fed through the buffers), every
    token plain decoding's; the exact heads' accepted drafts make catch-ups of 1 + k
    positions a request, which take the catch-up graphs."""
    target, head = (ckpts["base"], ckpts[method]) if which == "random" else \
        (ckpts["flat"], ckpts[f"{method}_exact"])
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 14, 3, 18)]
    want = _ids(_llm(target), prompts, params)
    seen = spy_drafts(monkeypatch)
    eager = _llm(target, head, method, spec={"backoff": False})
    assert _ids(eager, prompts, params) == want
    eager_seen = list(seen)
    seen.clear()
    llm = _llm(target, head, method, spec={"backoff": False})
    runner = llm.engine.proposer.runner
    runner.capture_graphs(8, llm.engine.max_model_len, capture=False)
    runner.capture_catchup_graphs(8, llm.engine.max_model_len, 1 + K, capture=False)
    assert _ids(llm, prompts, params) == want
    assert seen == eager_seen and len(seen) >= 10
    st = llm.engine.stats()["spec_decode"]
    assert st == eager.engine.stats()["spec_decode"]
    assert runner.graph_forwards > 0
    if which == "exact":
        assert st["acceptance_rate"] == 1.0 and runner.catchup_forwards > 0, st
    _no_leak(llm)


def test_the_cli_takes_method_eagle3(ckpts):
    """``--speculative-config '{"method": "eagle3", "model": ...}'`` builds the proposer."""
    spec = json.dumps({"method": "eagle3", "model": str(ckpts["eagle3_exact"]),
                       "num_speculative_tokens": 2})
    assert_cli_drafts_exactly(ckpts["flat"], spec)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_on_the_triton_backend(tmp_path):
    """The triton backend's kernels (interpreted) and our fused ops for a target of head_dim
    32 and the EAGLE-3 head's pool (one head of 64, q/k/v 2H wide): the exact head has every
    draft accepted, the tokens are torch_native's plain ones."""
    base = build_tiny_checkpoint(tmp_path / "base", "llama31_gqa", num_hidden_layers=LAYERS,
                                 num_attention_heads=2, num_key_value_heads=1)
    flat = edited_copy(base, tmp_path / "flat", _adds_nothing)
    head = _save(tmp_path / "e3x", eagle3_exact(_target_weights(flat)),
                 _config("eagle3", heads=1, kv_heads=1, draft_vocab_size=V))
    prompts = [random_prompts(1, 4, 4, seed=8)[0], random_prompts(1, 9, 9, seed=9)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = _ids(_llm(flat, block_size=16), prompts, params)
    llm = _llm(flat, head, "eagle3", attention_backend="triton", block_size=16,
               spec={"num_speculative_tokens": 2})
    assert llm.engine.backend_name == "triton"
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_gpu_tests_heads_on_the_cpu(gpu_ckpts, monkeypatch, method):
    """The GPU test's checkpoints (heads of 32 / 64) on the CPU: the exact head's drafts all
    accepted, the random head's equal to the reference's, plain decoding's tokens."""
    ckpts = gpu_ckpts
    prompts = random_prompts(3, 5, 30, seed=6)
    want = _ids(_llm(ckpts["flat"]), prompts)
    llm = _llm(ckpts["flat"], ckpts[f"{method}_exact"], method)
    assert _ids(llm, prompts) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    want = _ids(_llm(ckpts["base"]), prompts)
    llm = _llm(ckpts["base"], ckpts[method], method, spec={"backoff": False})
    seen = spy_drafts(monkeypatch)
    assert _ids(llm, prompts) == want
    assert_drafts_are_the_references(seen, ckpts, method, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_on_the_gpu_with_cuda_graphs(gpu_ckpts, monkeypatch, method):
    """fp32 on the GPU, triton backend, the target's graphs captured (decode, prompt-step,
    piecewise: they write the states the head reads) and the head's own: plain decoding's
    tokens, the exact head's drafts all accepted, the random head's every draft equal to
    the reference's, and the head's graphs replayed."""
    check_on_the_gpu(gpu_ckpts, monkeypatch, method)


def check_on_the_gpu(ckpts: dict[str, Path], monkeypatch, method: str) -> None:
    """test_on_the_gpu_with_cuda_graphs over ``ckpts`` (checkpoints as gpu_ckpts')."""
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=64)
    prompts = random_prompts(5, 5, 40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["flat"], **kw), prompts, params)
    llm = _llm(ckpts["flat"], ckpts[f"{method}_exact"], method, **kw)
    assert llm.engine.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)
    want = _ids(_llm(ckpts["base"], **kw), prompts, params)
    llm = _llm(ckpts["base"], ckpts[method], method, enable_prefix_caching=False,
               spec={"backoff": False}, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.piecewise is not None
    seen = spy_drafts(monkeypatch)
    assert _ids(llm, prompts, params) == want
    proposer = llm.engine.proposer
    assert isinstance(proposer, MTPProposer) and proposer.runner is not None
    assert proposer.runner.graph_forwards > 0
    assert_drafts_are_the_references(seen, ckpts, method, 20)
    _no_leak(llm)
