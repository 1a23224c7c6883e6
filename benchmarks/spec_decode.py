"""Speculative decoding (n-gram drafts) against plain decoding, in one process.

One engine (random --config weights, or --model), its proposer swapped between runs, every
run greedy with the same prompts. Random weights' greedy tokens hang on near-ties that the
verification's kernels (a short prompt chunk) and decode's break differently, so by default
the weights are arranged to count (--counting): every attention and MLP output projection
zeroed (the residual stream stays the token's embedding) and the LM head rolled so that
token t's next is t + 1 by a wide margin. The steps compute exactly what the 8B's do (the
same GEMMs, attention and cache traffic); only the answer is known. Each prompt is a random
block, a run t, t + 1, ... of --output-len / 2 tokens, another random block and t: its
output counts on from t, and for its first half repeats the prompt's run (what n-gram
lookup is for: copying from the context). Modes per batch size:

- plain: no drafts (async scheduling on, as the engine runs without speculation)
- ngram k=K: the real n-gram proposer; what it gains depends on how much of the model's
  output repeats what came before (random weights: whatever they do)
- right k=K / wrong k=K: drafts scripted from plain's own tokens, all right (every draft
  accepted: the most a step of k drafts can give) or all wrong (none accepted: the price
  of checking k drafts), which bound what any proposer gets from this model and machine
  (drafting's back-off off, so every step drafts)
- wrong+bo k=K: all wrong with the back-off on (engine/spec_decode.SpecBackoff), as a
  request whose drafts miss runs by default
- draft L=N k=K (with --draft-layers N ...): a draft model (engine/draft_model.py) of the
  target's shapes with its first N layers (0: all of them, the target itself), the
  target's weights for those (and, with --counting, counting too: every draft right); its
  own K/V pool over the target's blocks, its single-token forwards replayed from its decode
  CUDA graphs and its catch-ups of up to 1 + k tokens a request from its catch-up graphs,
  as the engine runs it; back-off off. What a step costs with an N-layer draft, beside
  "right k=K" (the same accepted drafts for free); each line counts the draft's graph
  forwards and, of its catch-ups, those replayed
- draft L=N k=K eager (with --draft-eager too): the same draft with its graphs (both kinds)
  set aside

- eagle k=K / eagle-wrong k=K (with --eagle, counting weights, the largest K only): an
  EAGLE-1 head of the target's width (one decoder layer with the target's attention and
  MLP shapes, fc over concat(embedding, state)) built to be right (fc = [I | 0] reads the
  embedding of the token fed, the layer adds nothing, the target's final norm and LM head:
  it predicts the counting target's next token exactly) or always wrong (fc = [0 | I]:
  the token after the target's state, i.e. the one already fed); the head costs what a
  published EAGLE-1 head of this shape costs (e.g. EAGLE-LLaMA3-Instruct-8B), so these
  bound what a real head gets beside "right" / "wrong" (free drafts)
- medusa k=K / medusa-wrong k=K (with --medusa, counting weights, the largest K only): K
  Medusa heads of the target's shapes (one residual block each, W = 0, b = 0, and an lm_head
  of the target's vocabulary) whose lm_heads are the target's LM head rolled so that head h
  predicts token p + 2 + h exactly (right) or p + 1 + h (always wrong); a head costs what a
  published Medusa head of this shape costs, so these bound what real heads get

Speculating modes schedule as the engine does (async on CUDA while nobody drafts).

Prints output tokens/s, the mean inter-token gap (ms), steps, and the drafts' acceptance
for each; checks every mode's tokens against plain's (greedy: they must be equal, bar
fp ties that verification's different kernels may break the other way).

    python benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 2 4 --json-out $OUT/spec.json
    python benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 4 --draft-layers 1 0
    python benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 4 --draft-layers 1 --draft-eager
    python benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 32 --ks 3 --eagle
    python benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 32 --ks 3 --medusa
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from flashpage.bench.common import resolve_config
from flashpage.engine.cuda_graph import DecodeGraphs, PrefillGraphs
from flashpage.engine.draft_model import DraftModelProposer, DraftRunner, check_draft_config
from flashpage.engine.medusa import MedusaProposer
from flashpage.engine.sequence import Request
from flashpage.engine.spec_decode import NgramProposer, SpecStats, SpeculativeConfig
from flashpage.layers.ops import set_fused_ops
from flashpage.llm import LLM
from flashpage.models.loader import ModelSource, load_model
from flashpage.sampling_params import SamplingParams


class ScriptedProposer(NgramProposer):
    """Drafts from known answers (by prompt index in the request id): right, or each +1."""

    answers: dict[str, list[int]]
    shift: int = 0
    vocab: int = 1

    def draft(self, req: Request, k: int) -> list[int]:
        ans = self.answers[req.request_id]
        i = req.num_output_tokens
        return [(t + self.shift) % self.vocab for t in ans[i:i + k]]


def make_counting(model: torch.nn.Module) -> None:
    """Zero every o_proj / down_proj and roll the LM head: greedy next token = token + 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb = model.model.embed_tokens.weight  # type: ignore[union-attr]
        norm_w = model.model.norm.weight.float()  # type: ignore[union-attr]
        head = model.lm_head.weight  # type: ignore[union-attr]
        assert head.data_ptr() != emb.data_ptr(), "tied embeddings: not supported here"
        for i in range(0, emb.shape[0], 8192):  # head[t + 1] = unit(norm_w * emb[t])
            u = torch.nn.functional.normalize(emb[i:i + 8192].float() * norm_w, dim=-1)
            rows = (torch.arange(i, i + u.shape[0], device=u.device) + 1) % emb.shape[0]
            head[rows] = u.to(head.dtype)


def draft_runner(llm: LLM, layers: int) -> DraftRunner:
    """A draft of the target's shapes with its first ``layers`` layers (0: all) and the
    target's weights for them (counting ones too, if the target's are), its pool on the
    target's blocks, its decode and catch-up graphs captured as the engine captures a
    draft's (where the target's are: CUDA, not enforce_eager)."""
    eng = llm.engine
    mc = eng.model_config
    cfg = dataclasses.replace(mc, num_hidden_layers=layers or mc.num_hidden_layers)
    source = ModelSource("random", None, cfg)
    model = load_model(source, eng.dtype, eng.device, max_positions=eng.max_model_len)
    missing = model.load_state_dict(eng.model.state_dict(), strict=False).missing_keys
    assert not missing, missing  # every draft weight is the target's (extra layers unused)
    backend = type(eng.runner.backend)
    set_fused_ops(model, backend.name == "triton")
    check_draft_config(cfg, mc)
    runner = DraftRunner(model, cfg, backend(cfg, eng.device, eng.dtype), eng.kv_manager,
                         eng.num_blocks, eng.config.block_size, eng.device, eng.kv_dtype, mc.vocab_size)
    if eng.runner.graphs is not None and backend.supports_cuda_graphs:
        eng._capture_draft_graphs(runner)
    return runner


def write_eagle_head(folder: str, target_config: str, dtype: torch.dtype) -> str:
    """An EAGLE-1 head checkpoint of ``target_config``'s shapes under ``folder`` (published
    names: fc with a bias, layers.0.* without input_layernorm, norm): the layer adds nothing
    (o_proj, down_proj zero), fc = [I | 0]; norm.weight ones, to be set to the target's
    final norm once it is loaded (``exact_eagle``)."""
    from safetensors.torch import save_file

    with open(os.path.join(target_config, "config.json") if os.path.isdir(target_config)
              else target_config) as f:
        c = json.load(f)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, inter = c.get("num_key_value_heads", heads), c["intermediate_size"]
    d = c.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(*shape, generator=g)).to(dtype)

    t = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1).to(dtype),
         "fc.bias": torch.zeros(h, dtype=dtype), "norm.weight": torch.ones(h, dtype=dtype),
         "layers.0.self_attn.q_proj.weight": r(heads * d, h),
         "layers.0.self_attn.k_proj.weight": r(kv * d, h),
         "layers.0.self_attn.v_proj.weight": r(kv * d, h),
         "layers.0.self_attn.o_proj.weight": torch.zeros(h, heads * d, dtype=dtype),
         "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
         "layers.0.mlp.gate_proj.weight": r(inter, h), "layers.0.mlp.up_proj.weight": r(inter, h),
         "layers.0.mlp.down_proj.weight": torch.zeros(h, inter, dtype=dtype)}
    save_file(t, os.path.join(folder, "model.safetensors"))
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")
    head_cfg = {k: c[k] for k in keep if k in c}
    head_cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, bias=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(head_cfg, f)
    return folder


def exact_eagle(llm: LLM, right: bool) -> None:
    """The EAGLE head's fc reading the embedding (right: counting's next token) or the
    target's state (wrong: the token already fed), and its norm the target's final norm."""
    prop = llm.engine.proposer
    assert prop is not None and getattr(prop, "runner", None) is not None
    layer = prop.runner.model  # type: ignore[attr-defined]
    h = layer.fc.weight.shape[0]
    w = layer.fc.weight
    with torch.no_grad():
        w.zero_()
        w[:, slice(0, h) if right else slice(h, 2 * h)] = torch.eye(h, dtype=w.dtype, device=w.device)
        layer.norm.weight.copy_(llm.engine.model.model.norm.weight)  # type: ignore[union-attr]


def write_medusa_heads(folder: str, target_config: str, k: int, dtype: torch.dtype) -> str:
    """A Medusa checkpoint of ``k`` heads of ``target_config``'s shapes under ``folder`` (one
    residual block each), all zeros: ``exact_medusa`` sets its lm_heads once the target is
    loaded."""
    from safetensors.torch import save_file

    with open(os.path.join(target_config, "config.json") if os.path.isdir(target_config)
              else target_config) as f:
        c = json.load(f)
    h, v = c["hidden_size"], c["vocab_size"]
    t: dict[str, torch.Tensor] = {}
    for i in range(k):
        t[f"blocks.{i}.layers.0.weight"] = torch.zeros(h, h, dtype=dtype)
        t[f"blocks.{i}.layers.0.bias"] = torch.zeros(h, dtype=dtype)
        t[f"lm_heads.{i}.weight"] = torch.zeros(v, h, dtype=dtype)
    save_file(t, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "medusa", "hidden_size": h, "vocab_size": v, "num_heads": k,
                   "num_hidden_layers": 1}, f)
    return folder


def exact_medusa(llm: LLM, right: bool) -> None:
    """Head h's lm_head the counting target's LM head rolled by h + 1 (right: it predicts
    token p + 2 + h) or by h (wrong: p + 1 + h); the blocks add nothing (zeros)."""
    prop = llm.engine.proposer
    assert isinstance(prop, MedusaProposer) and prop.heads is not None
    head = llm.engine.model.lm_head.weight  # type: ignore[union-attr]
    with torch.no_grad():
        for h, lm in enumerate(prop.heads.lm_heads):
            lm.weight.copy_(torch.roll(head, h + 1 if right else h, dims=0))  # type: ignore[operator]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams, iters: int) -> dict[str, Any]:
    eng = llm.engine
    times, gaps, steps, outs = [], [], [], []
    for _ in range(iters):
        n0 = eng.scheduler.num_steps
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        done: dict[str, Any] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        times.append(time.perf_counter() - t0)
        steps.append(eng.scheduler.num_steps - n0)
        outs = [done[str(i)] for i in range(len(prompts))]
        for o in outs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            if m is not None and m.first_token_time is not None and m.last_token_time is not None and n > 1:
                gaps.append((m.last_token_time - m.first_token_time) / (n - 1))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    t = statistics.median(times)
    return {"seconds": t, "output_tok_per_s": tokens / t, "itl_ms": 1e3 * statistics.median(gaps),
            "steps": statistics.median(steps), "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="random weights of this shape (e.g. llama-3-8b)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--block", type=int, default=24, help="the repeated block's length")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--no-counting", dest="counting", action="store_false",
                    help="keep the random weights as drawn (greedy tokens then flip on near-ties)")
    ap.add_argument("--draft-layers", type=int, nargs="*", default=[],
                    help="also time draft models of the target's shapes with this many of its "
                         "layers (0: all: the target as its own draft)")
    ap.add_argument("--draft-eager", action="store_true",
                    help="also time each --draft-layers draft with its CUDA graphs set aside "
                         "(eager forwards, as before the draft had graphs)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="KV blocks (default: from memory; 4096 with --draft-layers, as each "
                         "draft's pool has as many blocks as the target's)")
    ap.add_argument("--eagle", action="store_true",
                    help="also time an EAGLE-1 head of the target's shapes, right and always wrong "
                         "(counting weights; at the largest --ks only)")
    ap.add_argument("--medusa", action="store_true",
                    help="also time Medusa heads of the target's shapes, right and always wrong "
                         "(counting weights; at the largest --ks only)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    kmax = max(args.ks)
    blocks = args.num_gpu_blocks or (4096 if args.draft_layers or args.eagle else None)
    if args.eagle and args.medusa:
        ap.error("--eagle and --medusa: one at a time (the engine keeps one speculative config)")
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": kmax}
    if args.eagle:
        if not args.counting or args.config is None:
            ap.error("--eagle needs --config and the counting weights")
        head_dtype = {"float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.bfloat16)
        spec = {"method": "eagle", "num_speculative_tokens": kmax, "backoff": False,
                "model": write_eagle_head(tempfile.mkdtemp(), resolve_config(args.config) or "", head_dtype)}
    if args.medusa:
        if not args.counting or args.config is None:
            ap.error("--medusa needs --config and the counting weights")
        head_dtype = {"float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.bfloat16)
        spec = {"method": "medusa", "num_speculative_tokens": kmax, "backoff": False,
                "model": write_medusa_heads(tempfile.mkdtemp(), resolve_config(args.config) or "", kmax,
                                            head_dtype)}
    llm = LLM(args.model, random_weights_config=resolve_config(args.config), dtype=args.dtype,
              device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks=blocks, speculative_config=spec)
    eng = llm.engine
    ngram = eng.proposer
    assert ngram is not None
    eagle = ngram if args.eagle else None
    medusa = ngram if args.medusa else None
    vocab = eng.model_config.vocab_size
    if args.counting:
        make_counting(eng.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {"config": args.config or args.model, "counting": args.counting,
                               "device": str(eng.device),
                               "dtype": str(eng.dtype), "input_len": args.input_len,
                               "block": args.block, "output_len": args.output_len, "runs": []}
    runners: dict[int, DraftRunner] = {}  # one draft model (and pool) per layer count
    # their (decode, catch-up) graphs (None: eager only)
    captured: dict[int, tuple[DecodeGraphs | None, PrefillGraphs | None]] = {}
    for bs in args.batch_sizes:
        prompts = []
        for _ in range(bs):
            if args.counting:
                run = args.output_len // 2
                t = int(torch.randint(3, vocab - run - 1, (), generator=g))
                pad = max(args.input_len - run - 1, 2)
                a = torch.randint(3, vocab, (pad // 2,), generator=g).tolist()
                b = torch.randint(3, vocab, (pad - pad // 2,), generator=g).tolist()
                prompts.append(a + list(range(t, t + run)) + b + [t])
            else:
                block = torch.randint(3, vocab, (args.block,), generator=g).tolist()
                prompts.append((block * (args.input_len // args.block + 1))[: args.input_len])
        eng.proposer, eng.async_scheduling = None, eng.device.type == "cuda"
        _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 1)  # warm
        plain = _run(llm, prompts, params, args.iters)
        want = plain["token_ids"]
        # (name, proposer, the draft's decode and catch-up graphs for this mode: None = eager)
        modes: list[tuple[str, NgramProposer, tuple[DecodeGraphs | None, PrefillGraphs | None]]] = []
        for k in args.ks:
            cfg = SpeculativeConfig(num_speculative_tokens=k)
            bounds = SpeculativeConfig(num_speculative_tokens=k, backoff=False)
            modes.append((f"ngram k={k}", NgramProposer(cfg, eng.max_model_len), (None, None)))
            for name, shift, c in (("right", 0, bounds), ("wrong", 1, bounds), ("wrong+bo", 1, cfg)):
                sp = ScriptedProposer(c, eng.max_model_len)
                sp.answers = {str(i): a for i, a in enumerate(want)}
                sp.shift, sp.vocab = shift, vocab
                modes.append((f"{name} k={k}", sp, (None, None)))
            if eagle is not None and k == kmax:
                for name in ("eagle", "eagle-wrong"):
                    modes.append((f"{name} k={k}", eagle, (None, None)))
            if medusa is not None and k == kmax:
                for name in ("medusa", "medusa-wrong"):
                    modes.append((f"{name} k={k}", medusa, (None, None)))
            for n in args.draft_layers:
                if n not in runners:
                    runners[n] = draft_runner(llm, n)
                    captured[n] = runners[n].graphs, runners[n].catchup  # (each run sets the runner's own)
                # (the proposer reads k and backoff alone: a draft_model config wants a path)
                for eager in (False, True) if args.draft_eager else (False,):
                    graphs = (None, None) if eager else captured[n]
                    modes.append((f"draft L={n} k={k}{' eager' if eager else ''}", DraftModelProposer(
                        SpeculativeConfig(num_speculative_tokens=k, backoff=False), eng.max_model_len,
                        runner=runners[n]), graphs))
        rows = [("plain", plain, None)]
        for name, prop, graphs in modes:
            eng.proposer = prop
            prop.stats = SpecStats()
            if prop is medusa:
                exact_medusa(llm, right=name.startswith("medusa k="))
            elif prop is eagle:
                exact_eagle(llm, right=name.startswith("eagle k="))
                assert isinstance(prop, DraftModelProposer) and prop.runner is not None
                prop.runner.graph_forwards = prop.runner.catchup_forwards = 0
                eng.kv_manager.reset_prefix_cache()  # blocks cached by other modes: none in its pool
            elif isinstance(prop, DraftModelProposer):
                assert prop.runner is not None
                prop.runner.graphs, prop.runner.catchup = graphs
                prop.runner.graph_forwards = prop.runner.catchup_forwards = 0
                # blocks cached by the other modes hold no K/V in the draft's pool
                eng.kv_manager.reset_prefix_cache()
            r = _run(llm, prompts, params, args.iters)
            st = prop.stats.as_dict()
            if isinstance(prop, DraftModelProposer):
                assert prop.runner is not None
                st["draft_graph_forwards"] = prop.runner.graph_forwards
                st["draft_catchup_graph_forwards"] = prop.runner.catchup_forwards
            rows.append((name, r, st))
        for name, r, st in rows:
            same = sum(a == b for a, b in zip(r["token_ids"], want, strict=True))
            line = (f"batch {bs:3d} {name:19s} {r['output_tok_per_s']:9.1f} tok/s  ITL {r['itl_ms']:6.2f} ms  "
                    f"steps {r['steps']:5.0f}  x{r['output_tok_per_s'] / plain['output_tok_per_s']:.2f}")
            if st is not None:
                line += (f"  accepted {st['num_accepted_tokens']}/{st['num_draft_tokens']} "
                         f"({st['acceptance_rate']:.0%}), {st['mean_accepted_length']:.2f} tokens a draft step")
                if "draft_graph_forwards" in st:
                    line += (f", {st['draft_graph_forwards']} draft graph forwards, "
                             f"{st['draft_catchup_graph_forwards']} graphed catch-ups")
            line += f"  tokens = plain's: {same}/{bs}"
            print(line, flush=True)
            results["runs"].append({"batch": bs, "mode": name, **{k: v for k, v in r.items() if k != "token_ids"},
                                    "same_tokens": same, "spec": st})
    eng.proposer = ngram
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
