"""Encoder models (flashpage/encoder/) against transformers: throughput and agreement.

Random weights of a real shape (bge-base-en / e5-base: BertModel 12 x 768; bge-reranker-base:
XLMRobertaForSequenceClassification 12 x 768, vocab 250k; all-MiniLM-L6: BertModel 6 x 384;
gte-modernbert-base / modernbert-embed-base: ModernBertModel 22 x 768, a global layer every
third, the others a 128-token window),
the same weights loaded into transformers' model (SDPA attention). Per prompt length: N
random prompts through our EncoderEngine (batched by --max-num-batched-tokens, padded to each
batch's longest) and through transformers in batches of the same size, both in --dtype;
prompts/s and tokens/s of each, and how far apart their outputs are (embeddings: the
smallest cosine; reranker: the largest score difference)::

    python benchmarks/encoder.py --shape bge-base --lengths 32 128 512 --json-out $OUT/encoder_bge.json
    python benchmarks/encoder.py --shape bge-reranker-base --lengths 64 256 512
    python benchmarks/encoder.py --shape modernbert-base --lengths 128 512 2048

``--host-only``: both models' forwards replaced by a cached output of the batch's shape, so
what is timed is what each side does around them (ours: add_request, batching, pooling,
read-back, outputs; transformers': its input tensors, pooling); on a CPU the pooling's
arithmetic counts too::

    python benchmarks/encoder.py --shape minilm --lengths 8 32 --num-prompts 2048 --dtype float32 \
        --device cpu --host-only --repeat 7
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

SHAPES: dict[str, dict[str, Any]] = {
    "bge-base": dict(architectures=["BertModel"], model_type="bert", vocab_size=30522, hidden_size=768,
                     num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                     max_position_embeddings=512, type_vocab_size=2, pad_token_id=0),
    "minilm": dict(architectures=["BertModel"], model_type="bert", vocab_size=30522, hidden_size=384,
                   num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                   max_position_embeddings=512, type_vocab_size=2, pad_token_id=0),
    "bge-reranker-base": dict(architectures=["XLMRobertaForSequenceClassification"],
                              model_type="xlm-roberta", vocab_size=250002, hidden_size=768,
                              num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                              max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2, num_labels=1,
                              id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}),
    "modernbert-base": dict(architectures=["ModernBertModel"], model_type="modernbert", vocab_size=50368,
                            hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                            intermediate_size=1152, max_position_embeddings=8192, local_attention=128,
                            global_attn_every_n_layers=3, global_rope_theta=160000.0,
                            local_rope_theta=10000.0, norm_eps=1e-5, pad_token_id=50283,
                            bos_token_id=50281, eos_token_id=50282, cls_token_id=50281,
                            sep_token_id=50282),
}


def _prompts(n: int, length: int, cfg: dict[str, Any], seed: int) -> list[list[int]]:
    """[CLS] random ids [SEP] (BERT's 101 / 102; XLM-R's <s> 0 / </s> 2; ModernBERT's own)."""
    cls_id, sep_id = {"xlm-roberta": (0, 2), "modernbert": (50281, 50282)}.get(cfg["model_type"], (101, 102))
    g = torch.Generator().manual_seed(seed)
    return [[cls_id] + torch.randint(1000, cfg["vocab_size"], (length - 2,), generator=g).tolist() + [sep_id]
            for _ in range(n)]


def _ours(engine: Any, prompts: list[list[int]], task: str) -> tuple[torch.Tensor, float]:
    """Through the engine: requests added, batched, every output read back to the host
    (each a float32 numpy row, as RequestOutput.embedding holds it)."""
    from flashpage import PoolingParams

    params = PoolingParams(task=task, normalize=task == "embed")
    torch.cuda.synchronize() if engine.device.type == "cuda" else None
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o.embedding
    took = time.perf_counter() - t0
    return torch.from_numpy(np.stack([done[f"b{i}"] for i in range(len(prompts))])), took


def _hf(model: Any, prompts: list[list[int]], batch: int, task: str, device: str) -> tuple[torch.Tensor, float]:
    outs = []
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i: i + batch], device=device)
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
            if task == "embed":  # mean pooling, normalized (all prompts the same length)
                outs.append(torch.nn.functional.normalize(out.last_hidden_state.float().mean(1), dim=-1))
            else:
                outs.append(torch.sigmoid(out.logits.float()[:, :1]))
    if device == "cuda":
        torch.cuda.synchronize()
    return torch.cat(outs).cpu(), time.perf_counter() - t0


def _stub_forwards(ours: Any, hf: Any, hidden_size: int) -> None:
    """--host-only: each forward returns a cached random output of its input's shape."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        key = tuple(ids.shape)
        if key not in cache:
            cache[key] = torch.randn(*key, hidden_size, device=ids.device)
        return cache[key]

    dtype = next(ours.parameters()).dtype
    ours.forward = lambda ids, *a, **k: hidden(ids).to(dtype)

    def hf_forward(input_ids: torch.Tensor, **k: Any) -> SimpleNamespace:
        h = hidden(input_ids).to(hf.dtype)
        return SimpleNamespace(last_hidden_state=h, logits=h[:, 0, :1])

    hf.forward = hf_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="bge-base")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--json-out", default=None)
    p.add_argument("--host-only", action="store_true", help="forwards stubbed (module docstring)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each batch back before launching the next (CUDA's default overlaps them)")
    p.add_argument("--repeat", type=int, default=1, help="time each side this many times, keep the best")
    args = p.parse_args()

    import transformers

    from flashpage import LLM

    cfg = SHAPES[args.shape]
    task = "score" if "ForSequenceClassification" in cfg["architectures"][0] else "embed"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(cfg))
        llm = LLM(random_weights_config=str(path), dtype=args.dtype, device=args.device,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1 << 16,
                  async_scheduling=False if args.no_async_scheduling else None)
        engine = llm.engine
        hf_cfg = transformers.AutoConfig.from_pretrained(tmp)
        cls = getattr(transformers, cfg["architectures"][0])
        hf = cls._from_config(hf_cfg, attn_implementation="sdpa", dtype=getattr(torch, args.dtype))
    ours = engine.model.state_dict()  # type: ignore[attr-defined]
    hf_state = hf.state_dict()
    prefix = "roberta." if cfg["model_type"] == "xlm-roberta" else ""
    load = {(k if k in hf_state else prefix + k): v for k, v in ours.items()}
    missing, _ = hf.load_state_dict(load, strict=False)
    assert all("pooler" in k for k in missing), missing  # our embed models load no pooler
    hf = hf.to(args.device).eval()
    if args.host_only:
        _stub_forwards(engine.model, hf, cfg["hidden_size"])  # type: ignore[attr-defined]
    rows = []
    for length in args.lengths:
        prompts = _prompts(args.num_prompts, length, cfg, seed=length)
        batch = max(1, args.max_num_batched_tokens // length)
        _ours(engine, prompts[:batch], task)  # warm-up at the timed batch, as for transformers
        got, t_ours = _ours(engine, prompts, task)
        _hf(hf, prompts[:batch], batch, task, args.device)
        want, t_hf = _hf(hf, prompts, batch, task, args.device)
        for _ in range(args.repeat - 1):  # the best of --repeat, each side
            t_ours = min(t_ours, _ours(engine, prompts, task)[1])
            t_hf = min(t_hf, _hf(hf, prompts, batch, task, args.device)[1])
        mine = got.float()
        agree = (float(torch.nn.functional.cosine_similarity(mine, want, dim=-1).min()) if task == "embed"
                 else float((mine - want).abs().max()))
        tokens = args.num_prompts * length
        row = {"shape": args.shape, "dtype": args.dtype, "length": length, "prompts": args.num_prompts,
               "batch": batch, "ours_prompts_s": args.num_prompts / t_ours, "ours_tok_s": tokens / t_ours,
               "hf_prompts_s": args.num_prompts / t_hf, "hf_tok_s": tokens / t_hf,
               "speedup": t_hf / t_ours, "host_only": args.host_only, "repeat": args.repeat,
               "async_scheduling": getattr(engine, "async_scheduling", None),
               ("min_cosine" if task == "embed" else "max_score_diff"): agree}
        rows.append(row)
        print(json.dumps(row))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
